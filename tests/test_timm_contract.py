"""timm's model contract: the checks timm's own test suite runs on every model it ships (global pool removed
and restored, FX graphs that compute exactly what eager computes, TorchScript of the plain path)."""
import warnings

import pytest
import timm
import torch

import models  # noqa: F401  (registers the variants)


def test_global_pool_removed_keeps_the_map_and_reset_classifier_keeps_the_pool():
    x = torch.randn(2, 3, 64, 96)
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', num_classes=5).eval()
    torch.manual_seed(0)
    unpooled = timm.create_model('NALAFORMER_XT', num_classes=5, global_pool='').eval()
    with torch.no_grad():
        logits, pre = model(x), model.forward_head(model.forward_features(x), pre_logits=True)
        # without pooling: the hidden layer and the classifier at every position; their average is the pooled model's
        logit_map = unpooled(x)
        assert logit_map.shape == (2, 5, 2, 3)
        torch.testing.assert_close(logit_map.mean((2, 3)), logits, rtol=1e-4, atol=1e-5)
        model.reset_classifier(0)                                             # keeps the pool
        assert model.num_classes == 0 and model(x).shape == (2, model.head_hidden_size)
        torch.testing.assert_close(model(x), pre)
        model.reset_classifier(0, '')                                         # drops it
        assert model(x).shape == (2, model.head_hidden_size, 2, 3)
        torch.testing.assert_close(model(x).mean((2, 3)), pre, rtol=1e-4, atol=1e-5)
        bare = timm.create_model('NALAFORMER_XT', num_classes=0, global_pool='').eval()
        assert bare(x).shape == (2, bare.head_hidden_size, 2, 3)
        model.reset_classifier(0, 'max')
        assert model(x).shape == (2, model.head_hidden_size)
    with pytest.raises(ValueError, match="global_pool must be one of .*'catavgmax'"):
        timm.create_model('NALAFORMER_XT', global_pool='catavgmax')
    with pytest.raises(ValueError, match='global_pool'):
        model.reset_classifier(0, 'token')


def _fx_model(model):
    """The model as a torchvision FX feature extractor returning its output node (as timm's tests build it)."""
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names
    with warnings.catch_warnings():
        # train and eval graphs differ (drop path); the output node is named for each mode below
        warnings.filterwarnings('ignore', 'NOTE: The nodes obtained|The nodes obtained', UserWarning)
        train_nodes, eval_nodes = get_graph_node_names(model)
        return create_feature_extractor(model, train_return_nodes=[train_nodes[-1]],
                                        eval_return_nodes=[eval_nodes[-1]])


def test_fx_graph_computes_exactly_what_eager_computes():
    from models.nala import gated_norm_fast, lepe_fast, nala_attention_fast, softmax_attention_fast
    from models.nalaformer import conv_ffn_fast, conv_residual_fast
    model = timm.create_model('NALAFORMER_XT').eval()
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        out = model(x)
        fx_model = _fx_model(model)
        fx_out, = fx_model(x).values()
    assert torch.equal(fx_out, out)
    # the fast path's pieces are leaf calls of the graph
    targets = {node.target for node in fx_model.graph.nodes if node.op == 'call_function'}
    assert {nala_attention_fast, softmax_attention_fast, lepe_fast, gated_norm_fast, conv_residual_fast,
            conv_ffn_fast} <= targets


def test_torch_jit_script_runs_the_plain_path():
    model = timm.create_model('NALAFORMER_XT').eval()
    x = torch.randn(2, 3, 64, 96)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)                        # torch.jit is deprecated
        scripted = torch.jit.script(model)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x), rtol=0, atol=1e-5)
        model.set_fast_path(False)
        torch.testing.assert_close(scripted(x), model(x), rtol=0, atol=1e-5)


def test_fx_graph_of_a_scriptable_model_scripts():
    with timm.layers.set_scriptable(True):
        model = timm.create_model('NALAFORMER_XT').eval()
    assert not model.layers[0].blocks[0].attn.fast_path                        # set_scriptable: the plain path
    x = torch.randn(1, 3, 64, 64)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)
        scripted = torch.jit.script(_fx_model(model))
    with torch.no_grad():
        out, = scripted(x).values()
        torch.testing.assert_close(out, model(x), rtol=0, atol=1e-5)

