"""The load stage: N streaming clients (:mod:`~kvdiag.load.loadgen`; one request over either transport in
:mod:`~kvdiag.load.request`, its raw HTTP and SSE parser, latency statistics), the live progress line, and
which local process serves a URL. Readings taken while the load runs are the watch stage's; the saturation
judgement is analyze's."""
