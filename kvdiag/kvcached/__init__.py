"""What kvdiag knows about kvcached itself: its known defects, its PageAllocator banner and static risk
rule, its build fingerprint and live state, and the one reading of its ``KVCACHED_*`` settings."""
