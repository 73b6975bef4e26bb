"""`ktconvert export`: a conversion written out for other engines. hf: the hub-layout checkpoint (GPU layers as
stored, config with quantization_config), hf_experts: routed experts taken over losslessly into a GPU format."""
