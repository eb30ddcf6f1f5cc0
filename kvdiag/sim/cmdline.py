"""Command line of one simulated engine, for launchers: :func:`command`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvdiag.pymodule import module_argv


def _fmt(value: float) -> str:
    return f"{value:g}"


def command(
    port: int,
    *,
    host: str = "127.0.0.1",
    model: str | None = None,
    layers: int | None = None,
    kv_per_layer_mb: float | None = None,
    page_size_mb: int | None = None,
    allocator: str | None = None,
    prealloc: bool | None = None,
    backend: str | None = None,
    device_name: str | None = None,
    device_size_gb: float | None = None,
    weights_gb: float | None = None,
    gpu_memory_utilization: float | None = None,
    min_reserved_pages: int | None = None,
    max_reserved_pages: int | None = None,
    max_running: int | None = None,
    step_ms: float | None = None,
    tokens_per_page: int | None = None,
    map_latency_us: int | None = None,
    startup_s: float | None = None,
    preset: str | None = None,
    ipc_name: str | None = None,
    extra: Sequence[str] | Mapping[str, object] | None = None,
    python: str | None = None,
) -> list[str]:
    """Command line (argv) that starts one simulated engine: ``python -m kvdiag.sim serve ...``.

    ``None`` leaves a setting to the engine's default or kvcached's environment variables (for
    example ``prealloc=None`` follows ``KVCACHED_PAGE_PREALLOC_ENABLED``). ``extra`` is appended:
    a list of raw arguments, or a mapping ``{"fail-mode": "raise"}`` turned into ``--fail-mode raise``
    (``True`` adds the bare flag, ``False``/``None`` drop it).
    """
    argv = [*module_argv("kvdiag.sim", python), "serve", "--host", host, "--port", str(port)]
    opts: list[tuple[str, object]] = [
        ("--preset", preset), ("--model", model), ("--layers", layers), ("--kv-per-layer-mb", kv_per_layer_mb),
        ("--page-size-mb", page_size_mb), ("--allocator", allocator), ("--backend", backend),
        ("--device-name", device_name), ("--device-size-gb", device_size_gb), ("--weights-gb", weights_gb),
        ("--gpu-memory-utilization", gpu_memory_utilization), ("--min-reserved-pages", min_reserved_pages),
        ("--max-reserved-pages", max_reserved_pages), ("--max-running", max_running), ("--step-ms", step_ms),
        ("--tokens-per-page", tokens_per_page), ("--map-latency-us", map_latency_us),
        ("--startup-s", startup_s), ("--ipc-name", ipc_name),
    ]
    for flag, value in opts:
        if value is None:
            continue
        argv += [flag, _fmt(value) if isinstance(value, float) else str(value)]
    if prealloc is not None:
        argv += ["--prealloc", "true" if prealloc else "false"]
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            flag = key if key.startswith("--") else "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is not None and value is not False:
                argv += [flag, _fmt(value) if isinstance(value, float) else str(value)]
    elif extra is not None:
        argv += [str(a) for a in extra]
    return argv
