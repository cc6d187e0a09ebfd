"""Speech models: Whisper (speech in) and CSM (speech out)."""
