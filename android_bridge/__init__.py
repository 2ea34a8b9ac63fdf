"""On-device side of fedgc: the exported DGC encoder and training step, and the phone bridge.

``python -m android_bridge export --model NAME --out DIR`` writes the ExecuTorch and TorchScript
files (see :mod:`android_bridge.export`); :mod:`android_bridge.runtime` runs them.
"""
