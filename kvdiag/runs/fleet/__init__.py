"""Fleet capture: one bundle from many hosts.

- :mod:`.merge`: merges per-node bundles into one (``kvdiag merge`` of folders collected any
  way at all: ``kubectl exec``, ssh; and the Ray path below), processes keyed by (node, pid);
- :mod:`.select`: which Ray actors and workers to capture (pure, over Ray's state tables);
- :mod:`.node`: what runs on each node: kvdiag's own capture (:func:`kvdiag.capture.bundle.capture_pids`,
  the code behind ``capture --pid``), packed into bytes for the trip back;
- :mod:`.refusal`: why a node gave no usable evidence (pure: a task's error, a node's bundle);
- :mod:`.ray`: the transport through Ray (discovery from its state API, one task pinned to
  each node). It is the only module that imports ``ray``, and only inside its functions: Ray is a heavy
  optional dependency (``pip install 'kvdiag[ray]'``) that every other command must not pay for or need.
"""
