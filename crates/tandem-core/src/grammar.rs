//! Constrained decoding: a grammar (a JSON schema, or a Lark grammar) that the sampled tokens
//! must follow, enforced while sampling by masking every token the grammar cannot take next.
//! The grammar engine is llguidance (an Earley parser over a lexer of regular-expression
//! derivatives, computing each step's mask over the tokenizer's byte trie on demand, with no
//! per-grammar precomputation over the vocabulary), the one vLLM, SGLang and llama.cpp use.
//!
//! `Grammars` is made once per tokenizer (the trie of every token's bytes); a `Constraint` is one
//! compiled grammar, shared by the sequences that follow it (`n` choices), each of which takes a
//! `Matcher` of its own.

use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};

use crate::tokenizer::Tokenizer;

/// What compiles grammars for one tokenizer.
pub struct Grammars {
    factory: ParserFactory,
    /// Whether `<tool_call>` and `</tool_call>` are special tokens of the vocabulary (as in
    /// Qwen3.5's), which a tool call's grammar must then produce as such.
    special_tool_tags: bool,
}

impl Grammars {
    /// The token trie of `tokenizer` (its special tokens marked, so that a grammar's text never
    /// produces them); `ends`: the tokens that end a reply, allowed once the grammar is done.
    pub fn new(tokenizer: &Tokenizer, ends: &[u32]) -> Result<Grammars> {
        let n = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id).unwrap_or_default();
                if tokenizer.is_special(id) {
                    [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &bytes].concat()
                } else {
                    bytes
                }
            })
            .collect();
        let Some(&end) = ends.first() else { bail!("constrained decoding needs a token that ends a reply (the model has no end-of-turn token)") };
        let trie = TokTrie::from(&TokRxInfo::new(n as u32, end), &words).with_eos_tokens(ends);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).context("setting up the grammar engine")?;
        factory.quiet();
        let special = |tag: &str| tokenizer.token_id(tag).is_some_and(|id| tokenizer.is_special(id));
        Ok(Grammars { factory, special_tool_tags: special("<tool_call>") && special("</tool_call>") })
    }

    /// Replies that are JSON matching `schema` (a JSON schema; `{"type": "object"}` for any
    /// object), written as Python's json.dumps writes it (", " and ": " between items, no
    /// other whitespace) unless the schema's own `x-guidance` options say otherwise: with any
    /// whitespace allowed, a model can pad a reply with newlines until it runs out of tokens.
    /// An error names what the engine could not compile.
    pub fn json_schema(&self, schema: &serde_json::Value) -> Result<Constraint> {
        let mut schema = schema.clone();
        if let Some(o) = schema.as_object_mut().filter(|o| !o.contains_key("x-guidance")) {
            let compact = JsonCompileOptions { item_separator: ", ".into(), key_separator: ": ".into(), whitespace_flexible: false, ..Default::default() };
            o.insert("x-guidance".into(), serde_json::to_value(&compact)?);
        }
        self.compile(TopLevelGrammar::from_json_schema(schema))
    }

    /// Replies in the language of a Lark grammar (llguidance's dialect: `%json {...}` embeds a
    /// JSON schema).
    pub fn lark(&self, grammar: &str) -> Result<Constraint> {
        self.compile(TopLevelGrammar::from_lark(grammar.to_string()))
    }

    /// Replies that are one or more tool calls in Qwen3.5's form (`only`: exactly one call of
    /// that function), each function's arguments those its JSON schema (OpenAI's `tools`
    /// list) allows, in the schema's order, the required ones always there: a string parameter
    /// as free text (up to its maxLength, or one of its enum values), any other as JSON of its
    /// schema.
    pub fn tool_calls(&self, tools: &serde_json::Value, only: Option<&str>) -> Result<Constraint> {
        let lark = tool_call_lark(tools, only, self.special_tool_tags)?;
        self.compile(TopLevelGrammar::from_lark(lark)).context("the grammar of the tool calls")
    }

    fn compile(&self, grammar: TopLevelGrammar) -> Result<Constraint> {
        let matcher = Matcher::new(self.factory.create_parser(grammar));
        if let Some(e) = matcher.get_error() {
            bail!("{e}");
        }
        Ok(Constraint(Arc::new(Mutex::new(matcher))))
    }
}

/// The Lark grammar (llguidance's dialect) of tool calls in Qwen3.5's form.
fn tool_call_lark(tools: &serde_json::Value, only: Option<&str>, special_tags: bool) -> Result<String> {
    use serde_json::Value;
    let lit = |s: &str| Value::String(s.to_string()).to_string();
    let (open, close) = if special_tags { ("<tool_call>".to_string(), "</tool_call>".to_string()) } else { (lit("<tool_call>"), lit("</tool_call>")) };
    let compact = serde_json::to_value(JsonCompileOptions { item_separator: ", ".into(), key_separator: ": ".into(), whitespace_flexible: false, ..Default::default() })?;
    let mut rules = Vec::new();
    let mut calls = Vec::new();
    for (f, tool) in tools.as_array().map(Vec::as_slice).unwrap_or_default().iter().enumerate() {
        let Some(name) = tool.pointer("/function/name").and_then(Value::as_str) else { continue };
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let params = tool.pointer("/function/parameters");
        let required: Vec<&str> = params.and_then(|p| p.get("required")).and_then(Value::as_array).map(|r| r.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
        let mut items = Vec::new();
        for (k, (pname, schema)) in params.and_then(|p| p.get("properties")).and_then(Value::as_object).into_iter().flatten().enumerate() {
            let rule = format!("f{f}_p{k}");
            let head = lit(&format!("<parameter={pname}>\n"));
            let tail = lit("\n</parameter>\n");
            let ty = schema.get("type").and_then(Value::as_str);
            let body = match (ty, schema.get("enum").and_then(Value::as_array)) {
                (Some("string") | None, Some(values)) if values.iter().all(Value::is_string) => {
                    let alts: Vec<String> = values.iter().filter_map(Value::as_str).map(lit).collect();
                    format!("{rule}: {head} ({}) {tail}", alts.join(" | "))
                }
                (Some("string") | None, _) => {
                    // Free text up to the closing tag (lazily: it ends at the first one).
                    let len = schema.get("maxLength").and_then(Value::as_u64).map_or("*".to_string(), |n| format!("{{0,{n}}}"));
                    rules.push(format!("{rule}_text[lazy]: /(?s:.){len}/"));
                    format!("{rule}: {head} {rule}_text {tail}")
                }
                _ => {
                    let mut schema = schema.clone();
                    if let Some(o) = schema.as_object_mut() {
                        o.insert("x-guidance".into(), compact.clone());
                    }
                    format!("{rule}: {head} %json {schema} {tail}")
                }
            };
            rules.push(body);
            items.push(if required.contains(&pname.as_str()) { rule } else { format!("{rule}?") });
        }
        rules.push(format!("call{f}: {open} {} {} {} {close}", lit(&format!("\n<function={name}>\n")), items.join(" "), lit("</function>\n")));
        calls.push(format!("call{f}"));
    }
    if calls.is_empty() {
        match only {
            Some(name) => bail!("no function named {name:?} among the tools"),
            None => bail!("no functions to call"),
        }
    }
    let start = match only {
        Some(_) => "start: call".to_string(),
        None => format!("start: call ({} call)*", lit("\n")),
    };
    Ok(format!("{start}\ncall: {}\n{}\n", calls.join(" | "), rules.join("\n")))
}

/// A compiled grammar, at its start; each sequence that follows it takes its own matcher.
#[derive(Clone)]
pub struct Constraint(Arc<Mutex<Matcher>>);

impl Constraint {
    /// A matcher at the grammar's start, for one sequence.
    pub fn matcher(&self) -> Matcher {
        self.0.lock().expect("grammar lock").deep_clone()
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

/// Two constraints are the same where they are the same compiled grammar.
impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// One sequence's place in a grammar: its matcher, the token it took last (not yet fed to the
/// matcher), and the mask for its next token once computed. Feeding the token and computing the
/// next mask both happen in `prepare`, which a GPU engine's decode loop runs on other threads
/// while the GPU computes the logits that the mask will apply to; a sampler that finds it not
/// done does it when it picks. (A token a mask allowed is one the matcher takes: a refusal, an
/// error of the grammar engine, is reported at the next pick.)
pub struct Follower {
    matcher: Matcher,
    taken: Option<u32>,
    next: Option<Result<SimpleVob, String>>,
}

impl Follower {
    /// At the grammar's start.
    pub fn new(constraint: &Constraint) -> Follower {
        Follower { matcher: constraint.matcher(), taken: None, next: None }
    }

    /// Feed the matcher the token taken last, and compute the mask for the next one (where not
    /// done yet).
    pub fn prepare(&mut self) {
        if self.next.is_some() {
            return;
        }
        let mut next = || {
            if let Some(token) = self.taken.take() {
                // An end token once the grammar is complete is the reply's end, not the grammar's.
                if !self.matcher.is_stopped() {
                    self.matcher.consume_token(token).map_err(|e| anyhow::anyhow!("the grammar engine refused token {token}: {e}"))?;
                }
            }
            allowed(&mut self.matcher)
        };
        self.next = Some(next().map_err(|e| format!("{e:#}")));
    }

    /// Whether the next token's mask is computed.
    pub fn prepared(&self) -> bool {
        self.next.is_some()
    }

    /// The tokens allowed next (bit i: token i), computed now where `prepare` has not.
    pub fn mask(&mut self) -> Result<&[u32]> {
        self.prepare();
        match &self.next {
            Some(Ok(mask)) => Ok(mask.as_slice()),
            Some(Err(e)) => Err(anyhow::anyhow!("{e}")),
            None => unreachable!("prepared above"),
        }
    }

    /// Note the token taken next (from the mask).
    pub fn take(&mut self, token: u32) {
        self.taken = Some(token);
        self.next = None;
    }
}

/// The tokens `matcher` allows next (bit i: token i; once the grammar is complete, only the end
/// tokens). An error where the engine fails or allows nothing.
pub fn allowed(matcher: &mut Matcher) -> Result<SimpleVob> {
    let allowed = matcher.compute_mask_or_eos().map_err(|e| anyhow::anyhow!("the grammar engine: {e}"))?;
    if allowed.num_set() == 0 {
        bail!("the grammar allows no token here");
    }
    Ok(allowed)
}

/// Leave in `row` (logits over the tokenizer's ids) only what `allowed` allows: every other
/// token's logit, and any past the mask's ids, becomes -inf (as kernels/sample.cu mask_rows
/// does on a GPU). A word at a time: a grammar's mask is mostly whole words of one kind.
pub fn apply(allowed: &[u32], row: &mut [f32]) {
    for (w, chunk) in row.chunks_mut(32).enumerate() {
        let bits = allowed.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if (bits >> b) & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}
