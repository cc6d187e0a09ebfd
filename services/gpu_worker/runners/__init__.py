"""The runners, one module per model kind: `base.ModelRunner` runs decoders (one step of
rows through the model over paged KV), and each kind adds its own work to it (an encoder
pass at admission, a state batch, a codec, pooling); `build.py` picks one by the spec's
engine kind."""
