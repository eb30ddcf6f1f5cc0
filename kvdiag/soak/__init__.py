"""The load stage: N streaming clients (:mod:`~kvdiag.soak.loadgen`, its raw HTTP and SSE parser, latency
statistics), the saturation sampler, and which local process serves a URL. ``kvdiag soak``'s lifecycle is
:mod:`kvdiag.soakrun`."""
