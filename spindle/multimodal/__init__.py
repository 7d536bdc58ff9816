"""What models that take more than text need: decoding and cutting audio uploads
(audio_io), a request's media made into encoder inputs (processor), and the decoder
prompts of speech models (whisper_prompt)."""
