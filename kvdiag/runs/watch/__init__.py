"""`kvdiag watch`: the sentinel beside running servers (:mod:`.session` wires it; :mod:`.sentinel` tracks
each engine, :mod:`.events` and :mod:`.exporter` say what it saw, :mod:`.retention` bounds what it keeps)."""
