"""Where bytes go — stage: runtime (both executors).

Input: the strategy's mesh and the model's device. Output: `ShardMesh` and its groups
(`mesh.py`), the experts' meshes (`experts.py`), devices and streams (`device.py`), the
quantization codecs (`quant.py`) and the all-to-all reduce-scatters' local halves (`a2a.py`).
"""
