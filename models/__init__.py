"""Model code the stages load and run: the repository layout, the DiT, the video decoder, quantized linears."""
