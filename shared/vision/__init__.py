"""Image inputs of vision-language models: preprocessing and prompt expansion in numpy and
Pillow, so the data worker turns a client's image into pixel values without torch."""
