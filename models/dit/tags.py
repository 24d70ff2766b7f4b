"""The modality tag of each row of the packed sequence. Tags index the AdaLN table, so the values are a checkpoint
contract; a vision block's rows inside the text are tagged as video."""

VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
MODALITIES = 3
