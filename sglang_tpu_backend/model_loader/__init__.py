"""Model loading: from a checkpoint on disk to parameter leaves in their device shardings.

``checkpoint_io`` reads and writes safetensors (tensor index, FP8 block scales, atomic
directory replace); ``checkpoint_shapes`` checks a checkpoint's tensors against the config;
``loader`` turns a checkpoint into lazily read param leaves and the whole-params host load;
``sharded_loader`` reads each device's share layer by layer into its sharding (or draws
``--load-format dummy`` weights per shard) and ``host_load`` stages those reads through host
memory; ``tiny_model`` builds the embedded tiny default model. Nothing is re-exported here:
import the module you need (``from sglang_tpu_backend.model_loader.loader import load_params``).
"""
