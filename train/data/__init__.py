"""The data path: pinned dataset versions streamed with Streaming, per-sample draws, packed batches, leases
against gc."""
