"""The data path: pinned dataset versions streamed with Streaming (one dataset, or a data.streams mix with
per-stream sample counts), per-sample draws (new ones for each copy of an upsampled sample), packed batches,
leases against gc, and Streaming's shared memory and cache folders made safe on a shared host."""
