"""The ground floor: types every layer shares, importing nothing else from roll.

Layers, each importing only from those below it (``tests/test_import_layers.py`` checks this):

    roll.core          Batch, SamplingParams, WorkerContext, LossFn, Role
    roll.configs       parses and types the YAML (a leaf above core)
    roll.utils         helpers without roll state
    roll.models        model code: builds, forwards, packs, converts
    roll.distributed   strategies, Ray workers and clusters, model update
    roll.pipeline      the RLVR and SFT drivers, rewards, algorithms

See docs/architecture.md.
"""
