"""The on-disk block store: format, pack, read, verify, inspect, repair."""
