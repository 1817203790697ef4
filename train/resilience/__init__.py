"""Unattended runs, the rank side: save and stop on a signal or a deadline, heartbeats, a wall-clock save
cadence, exit records for the supervisor (shared/launch/supervisor.py), and the plan's resilience numbers."""
