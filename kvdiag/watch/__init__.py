"""Watch stage: log tailing, banner parsing, health and metrics polling, stall detection."""
