//! The tokenizer a GGUF describes in its metadata, written as the
//! `tokenizer.json` / `tokenizer_config.json` / `chat_template.jinja` that
//! `transformers` builds from the same file.
//!
//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`: GPT-2, SmolLM, Llama 3,
//! Qwen2/2.5/3) is supported. The text is split before BPE the way the merges
//! were learned, named by `tokenizer.ggml.pre`; an unknown name is an error
//! rather than a silently different tokenisation.

use serde_json::{Map, Value, json};

use crate::GgufError;
use crate::file::GgufFile;

/// llama.cpp's token types: 3 = control (`<|im_end|>`), 4 = user-defined (`<think>`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How `tokenizer.ggml.pre` splits text: `None` is GPT-2's own regex.
fn split_regex(pre: Option<&str>) -> Result<Option<&'static str>, String> {
    match pre {
        None | Some("default" | "gpt2" | "smollm") => Ok(None),
        Some("llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe") => Ok(Some(LLAMA3_SPLIT)),
        Some("qwen2" | "deepseek-r1-qwen") => Ok(Some(QWEN2_SPLIT)),
        Some(other) => Err(format!(
            "{other:?} is not supported (default, gpt2, smollm, llama3, llama-bpe, smaug-bpe, qwen2, deepseek-r1-qwen)"
        )),
    }
}

/// GPT-2's reversible byte-to-character map: printable bytes stand for
/// themselves, the rest for the characters from U+0100 on.
fn byte_alphabet() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        map[b as usize] = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below the surrogates")
        };
    }
    map
}

pub struct TokenizerFiles {
    pub tokenizer_json: Value,
    pub tokenizer_config: Value,
    pub chat_template: Option<String>,
    pub vocab_size: usize,
}

pub fn build(file: &GgufFile, context_length: u64) -> Result<TokenizerFiles, GgufError> {
    let model = file.require_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(file.metadata_error(
            "tokenizer.ggml.model",
            format!("{model:?} is not supported (gpt2: byte-level BPE; sentencepiece vocabularies are not yet)"),
        ));
    }
    let pre = file.get("tokenizer.ggml.pre").and_then(|v| v.as_str());
    let split = split_regex(pre).map_err(|reason| file.metadata_error("tokenizer.ggml.pre", reason))?;
    let tokens = file.strings("tokenizer.ggml.tokens")?;
    let merges = file.strings("tokenizer.ggml.merges")?;
    let token_types = match file.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(value) => value
            .as_array()
            .filter(|items| items.len() == tokens.len())
            .and_then(|items| items.iter().map(|t| t.as_f64().map(|t| t as i64)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| {
                file.metadata_error("tokenizer.ggml.token_type", format!("not {} integers", tokens.len()))
            })?,
    };

    // llama.cpp stores tokens as text; a byte-level vocabulary spells them in
    // the byte alphabet, so any token that is not is re-spelled byte by byte.
    let alphabet = byte_alphabet();
    let in_alphabet: std::collections::HashSet<char> = alphabet.into_iter().collect();
    let spelled = |token: &str| token.chars().all(|c| in_alphabet.contains(&c));
    let mut vocab = Map::new();
    for (id, token) in tokens.iter().enumerate() {
        let key =
            if spelled(token) { (*token).to_owned() } else { token.bytes().map(|b| alphabet[b as usize]).collect() };
        vocab.insert(key, json!(id));
    }
    let merges: Vec<Value> = merges
        .iter()
        .enumerate()
        .map(|(i, merge)| match merge.split_once(' ') {
            Some((left, right)) => Ok(json!([left, right])),
            None => Err(file.metadata_error("tokenizer.ggml.merges", format!("item {i} {merge:?} is not \"a b\""))),
        })
        .collect::<Result<_, _>>()?;

    // Control tokens stay whole and are special; user-defined ones stay whole
    // and are plain text. A "control" token outside the byte alphabet is a
    // llama.cpp mislabel and is left to BPE, as transformers does.
    let added: Vec<Value> = tokens
        .iter()
        .zip(&token_types)
        .enumerate()
        .filter_map(|(id, (token, kind))| {
            let special = match *kind {
                CONTROL if spelled(token) => true,
                USER_DEFINED => false,
                _ => return None,
            };
            Some(json!({
                "id": id, "content": token, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special,
            }))
        })
        .collect();

    let byte_level = |use_regex: bool, add_prefix_space: bool| json!({ "type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true, "use_regex": use_regex });
    let pre_tokenizer = match split {
        None => byte_level(true, false),
        Some(regex) => json!({
            "type": "Sequence",
            "pretokenizers": [
                { "type": "Split", "pattern": { "Regex": regex }, "behavior": "Isolated", "invert": false },
                byte_level(false, false),
            ],
        }),
    };

    let token_of = |key: &str| -> Result<Option<&str>, GgufError> {
        let Some(id) = file.optional_u64(key)? else { return Ok(None) };
        tokens.get(id as usize).copied().map(Some).ok_or_else(|| {
            file.metadata_error(key, format!("token id {id} is outside the vocabulary of {}", tokens.len()))
        })
    };
    let bos = token_of("tokenizer.ggml.bos_token_id")?;
    let add_bos = file.get("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false);
    let post_processor = match bos.filter(|_| add_bos) {
        None => json!({
            "type": "TemplateProcessing",
            "single": [{ "Sequence": { "id": "A", "type_id": 0 } }],
            "pair": [{ "Sequence": { "id": "A", "type_id": 0 } }, { "Sequence": { "id": "B", "type_id": 1 } }],
            "special_tokens": {},
        }),
        Some(bos) => {
            let id = file.require_u64("tokenizer.ggml.bos_token_id")?;
            json!({
                "type": "TemplateProcessing",
                "single": [{ "SpecialToken": { "id": bos, "type_id": 0 } }, { "Sequence": { "id": "A", "type_id": 0 } }],
                "pair": [
                    { "SpecialToken": { "id": bos, "type_id": 0 } }, { "Sequence": { "id": "A", "type_id": 0 } },
                    { "SpecialToken": { "id": bos, "type_id": 1 } }, { "Sequence": { "id": "B", "type_id": 1 } },
                ],
                "special_tokens": { bos: { "id": bos, "ids": [id], "tokens": [bos] } },
            })
        }
    };

    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": byte_level(true, true),
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });

    let mut config = Map::new();
    config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    config.insert("model_max_length".into(), json!(context_length));
    config.insert("add_bos_token".into(), json!(add_bos));
    for (name, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(token) = token_of(key)? {
            config.insert(name.into(), json!(token));
        }
    }
    let chat_template = file.get("tokenizer.chat_template").and_then(|v| v.as_str()).map(str::to_owned);

    Ok(TokenizerFiles {
        tokenizer_json,
        tokenizer_config: Value::Object(config),
        chat_template,
        vocab_size: tokens.len(),
    })
}
