"""What a run reads: the prompts file, the media it names, the requests made of them."""
