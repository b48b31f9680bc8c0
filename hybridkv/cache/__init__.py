"""The hybrid cache: pure bookkeeping (blocks, slots, snapshots) over preallocated tensor pools."""
