"""`kvdiag soak` as a configuration of the one run (:func:`kvdiag.runs.lifecycle.run_lifecycle`): its options and
scenario (:mod:`.options`), the server it loads (:mod:`.subject`), its stages (:mod:`.session`) and its
load phase (:mod:`.drive`): the load stage driven under the serving watchdog, the /metrics poller and the
saturation sampler, a stall captured while its requests are in flight, the load's figures and readings
into the bundle."""
