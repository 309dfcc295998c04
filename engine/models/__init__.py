"""Model families behind one interface (`engine.models.base.CausalLM`), found by architecture
name through `engine.models.registry`."""
