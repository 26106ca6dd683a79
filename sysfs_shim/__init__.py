"""The status tree under the runtime dir -- the user-space mirror of /sys/kernel/deepseek_flash."""
