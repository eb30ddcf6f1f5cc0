"""What an engine's log lines say: kvcached's PageAllocator banner (and its static risk rule) and the
start-up phase, pids and error lines. Pure text in, typed records out; shared by watch (which follows the
log live), capture (which reads a bare process's log tail), analyze and report."""
