"""The hf-diloco Gradio app: launch recipes, watch sync rounds live, push the model to the Hub."""
