"""Reading a checkpoint: where its components live in either layout (`resolver`, `native`), its files and configs
(`file_reading`, `native_config`), torch-free; and its tensors read lazily into meta-built modules (`weights`,
torch)."""
