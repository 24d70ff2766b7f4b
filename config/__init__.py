"""Configuration: presets, adapter contracts, stage configs built from preset values."""
