"""Robot policies: a vision-language prefix over paged KV and an action expert that
denoises an action chunk by flow matching while reading that prefix (Pi0)."""
