"""Every command's run: the one lifecycle (:mod:`.lifecycle`), its output folder (:mod:`.output`), a
scenario's engines brought up and watched (:mod:`.engines`), and each command's configuration of it
(repro and ab, capture, watch, soak, sweep, fleet)."""
