"""How a job's process runs: its device and precision (`device`); the torch / CUDA / Python range it is
tested on and what `make install TORCH=system` installs beside a machine's own torch (`stack`, torch-free
so an image's interpreter runs it before anything is installed); how a command ends for the person who
typed it (`exits`); environment variables set for a block and then restored (`environ`); child processes
that die with their parent, and a training rank's loader workers (`children`). Imports nothing, so
`python -m shared.runtime.stack` needs only the standard library."""
