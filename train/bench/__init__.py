"""`make bench` / `python -m train bench [CONFIG] [key=value ...]`: throughput, FLOPs and MFU on this device.

One process measures, on synthetic inputs of the preset's exact shapes (warm-up excluded, medians of repeats):
- flops:   FLOPs per image of the U-Net forward and train step, VAE encoder and text tower (FlopCounterMode),
           and the ideal offline speedup they imply;
- train:   per resolution, the train job's step on precomputed latents (images/s per device, MFU) and the
           online baseline that encodes pixels and captions inside the step -> the measured offline speedup;
- loader:  train's real StreamingDataLoader over a real MDS dataset on disk, vs the step and vs a raw read;
- trainer: the real Composer trainer (EMA, clipping, callbacks, logging) vs the bare step on its own model,
           and the recipe as a run of it trains (its FSDP, its microbatch);
- encode:  the real encode pipeline on sample data vs its stages alone.

Writes `<out_dir>/bench.json` (shared/estimate reads it: `make estimate ARGS='throughput_from=...'`) and
`<out_dir>/bench.md`. Configs: jobs/bench/*.yaml (quick: tiny preset, minutes on a laptop CPU; full: SD2
base on a GPU; sd2-base-cpu: SD2 base at batch 1 on CPU). Modules: config (the
bench config), step (train step, FLOPs), data (loader), trainer/ (the Composer trainer), anatomy/ (where the
step's time goes), precompile (compiles side by side first), run (the sections), report (findings,
markdown, JSON), cli (the typer command); encode's side is encode/bench.py.
"""
