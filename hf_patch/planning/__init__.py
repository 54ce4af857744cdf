"""Which prompts run together and where: ``batches`` (batches that keep shared prefixes adjacent,
for generate_many and scoring) and ``routing`` (which data-parallel rank serves which request,
for batchrun and evalrun)."""
