"""The coordinator: token ids only. Engine link, dispatcher, handover, router, role changes, the mix controller."""
