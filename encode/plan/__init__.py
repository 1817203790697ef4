"""What must be (re)done: stage fingerprints, done-markers, what an output folder may hold, what can be
reused, and that no other run does it at the same time (each rank's claim on the output)."""
