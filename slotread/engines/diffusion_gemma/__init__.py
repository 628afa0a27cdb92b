"""The DiffusionGemma engine, laid out by what each part does.

A read's path: ``engine.DiffusionGemmaEngine.read`` checks the requests, then
``kv_schedule.resume`` (what the prefix cache holds), ``kv_schedule.deferrable`` (new last segments
left to the canvases' forward), ``kv_schedule.encode_waves`` with ``forward.encode`` (the rest of
the prompts' KV); ``read_plan.joint_chunks`` and ``forward.encode_decode`` (new states with their
canvases), ``read_plan.split`` and ``read_plan.decoder_chunks`` with ``forward.decode`` (canvases of
cached prompts); ``assemble`` builds each forward's tensors, ``OutputHead`` scores the slots.

* the read recipe: ``engine.py``; its fast paths, each switched by an option and logged at start-up:
  ``fast_paths.py``;
* KV scheduling: ``kv_schedule.py`` (what to encode, in which waves and batches, what to defer),
  ``read_plan.py`` (how each read takes its prompt KV, which reads share a forward);
* the forward: ``inputs.py`` (what it takes), ``assemble.py`` (building that from requests),
  ``forward.py`` (encode, decode, both at once), ``layer.py`` (one layer), ``layer_attention.py``
  (who attends to what, in parts), ``attention.py`` (the attention kernels and their merge);
* the fast paths' kernels: ``fused.py`` (compiled elementwise chains), ``kernels.py`` (Triton),
  ``invariant.py`` (batch-invariant reads), ``graphs.py`` (CUDA graphs);
* around the read: ``noise.py`` (the canvas noise, shared with the remote engine), ``denoise.py``
  (multi-step reads), ``thought.py`` (thoughts by block diffusion), ``vision.py`` (images).

Import the engine from ``engine.py``: this package's init imports nothing, so a module that needs one
piece (the remote engine's ``noise``, ``scores``' batch-invariant projection) does not load the rest.
"""
