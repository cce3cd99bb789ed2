"""How an attempt ends, and what it costs: signals, the grace period, notices, the interval.

signals   catching SIGTERM and SIGINT without losing them
grace     after a stop signal: the last save if it fits, the attempt's end, the exit
notices   clouds' notices of a coming preemption, from the metadata service
interval  ``every="auto"``: the save interval that wastes least
goodput   where the attempt's time went
"""
