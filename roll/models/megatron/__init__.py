"""megatron-core models for roll: build GPTModel chunks from HF checkpoints and convert weights.

- ``families``: supported HF ``model_type``s and their megatron-core config;
- ``weight_mapping``: HF <-> Megatron weight tables and layouts;
- ``model_builder``: ``build_model_chunks`` under megatron's parallel_state;
- ``hf_io``: ``load_hf_weights``, ``export_hf_weights``, ``save_hf_checkpoint``.
"""
