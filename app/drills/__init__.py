"""Fault drills: the reliability drill and the faults it injects (kills, outages, bad messages)."""
