"""`kvdiag sweep`: a scenario run over a grid of settings (or bisected along one axis), each cell a
full `repro` run, repeated into rates; the boundary inferred as a rule and checked against the
banner's static risk rule."""
