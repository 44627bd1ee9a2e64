import torch

from miles_platform.models.checkpoint import content_hash, load_hf_checkpoint


def test_tiny_checkpoint_reloads_with_identical_logits(tiny_hf_checkpoint):
    model, tok = load_hf_checkpoint(tiny_hf_checkpoint)
    ids = torch.tensor([tok.encode("What is 12+34? ")])
    a = model(ids).logits
    model2, _ = load_hf_checkpoint(tiny_hf_checkpoint)
    assert torch.equal(a, model2(ids).logits)
    assert tok.decode(tok.encode("What is 12+34? 46")) == "What is 12+34? 46"
    assert len(content_hash(tiny_hf_checkpoint)) == 32
