"""What must be (re)done: stage fingerprints, done-markers, what an output folder may hold, what can be
reused."""
