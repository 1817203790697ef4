"""Where a train step's time goes (`make bench`'s `anatomy` section): ATen ops by family and phase from the
torch profiler, bytes moved and fp32 work under autocast, compile graphs / breaks / recompiles and compile
time, activation memory per image and the batch per GPU it allows, and each speed switch's own gain."""
