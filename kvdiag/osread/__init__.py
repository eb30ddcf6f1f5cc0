"""The one reading layer: the only code that reads the operating system about a process.

/proc (stat, status, tasks, syscalls, wchan, maps, fds, io), the target's memory, netlink sock_diag and
/proc/net, children and shared mappings are read here and returned as plain typed records. No policy lives
here: nothing is judged, nothing is retried, nothing decides what to capture. Capture, environment, doctor,
launch and watch call into this package; a new reading of the OS is added here once.
"""
