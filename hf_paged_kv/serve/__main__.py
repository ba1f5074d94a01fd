"""`python -m hf_paged_kv.serve`: see `hf_paged_kv.serve.cli`."""

from .cli import main

main()
