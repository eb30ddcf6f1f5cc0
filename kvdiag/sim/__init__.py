"""The simulated engine: a vLLM-shaped server (API server + EngineCore) on kvdiag's page allocators.

Run it with ``python -m kvdiag.sim serve ...`` or ``kvdiag sim serve ...`` (``--help`` lists every
flag); build its command line from Python with :func:`kvdiag.sim.cmdline.command`; start/stop it from Python with
:class:`kvdiag.sim.harness.SimProcess`.

Behaviours and the options that produce them (all real: the processes really hang or die):

* co-located init deadlock (seed #371, A): engine 1 ``--layers 64 --kv-per-layer-mb 283
  --weights-gb 33``, then engine 2 on the same ``--device-name`` with ``--layers 28
  --kv-per-layer-mb 11 --page-size-mb 2 --min-reserved-pages 5 --max-reserved-pages 5
  --allocator stock`` and prealloc on: engine 2 prints the banner and hangs in the null-block
  ``alloc_page`` (GIL cycle). ``KVCACHED_PAGE_PREALLOC_ENABLED=false`` or ``--allocator fixed``
  starts it.
* runtime decode stall (seed #371, B): ``--preset decode-stall --allocator stock`` under ~32
  concurrent streaming requests wedges within seconds: /health 200, /metrics answers (stale), KV
  usage > 90 %, requests running, no tokens. ``--allocator fixed`` serves the same load.
* healthy-but-slow start: ``--slow-phase load|profile|warmup --slow-s S`` (progress lines and CPU).
* crash / OOM: ``--fail-mode signal|raise|oom --fail-at load|profile|warmup|kv_init|serving``
  (``--fail-signal``, ``--fail-after-s``, ``--fail-after-tokens``); oom at kv_init/serving fills
  the modelled device so the next KV page map really fails.

Kept import-light: the EngineCore spawn child imports this package, and it must not pay for uvicorn.
"""
