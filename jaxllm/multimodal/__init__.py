"""Image inputs in the front end: where an image comes from (`media`: a data: URL, a local
file under --allowed-local-media-path, a PIL image or an array), how a chat's image parts
reach the chat template (`chat`), and how the model's own Hugging Face processor turns a prompt
and its images into token ids with each image's placeholder tokens and its pixels
(`processor`). The engine core receives the pixels in its typed messages
(`jaxllm.worker.MultiModalItem`)."""
