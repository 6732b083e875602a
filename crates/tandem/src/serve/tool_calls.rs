//! Tool calls as Qwen3.5 writes them (the XML form its chat template teaches):
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! read out of a reply as it streams. Text outside the blocks is the message's content (the
//! whitespace between it and a call left out); a block that parses, naming one of the request's
//! functions, becomes a call whose arguments are JSON, each value typed by the function's
//! schema (a string stays a string; integers, numbers, booleans, arrays and objects are read as
//! JSON); a block that does not parse, or one the reply never closes, is given back as text.
//! One reader serves a streamed and a whole reply, so that both say the same.

use serde_json::{Map, Value};

/// A function the request offers: its name and the JSON type of each parameter its schema
/// types.
#[derive(Clone, Debug)]
pub struct Tool {
    pub name: String,
    pub params: Vec<(String, String)>,
}

impl Tool {
    /// The tools of a request's `tools` list (checked by the request parser: each has a name).
    pub fn list(tools: &Value) -> Vec<Tool> {
        let items = tools.as_array().map(Vec::as_slice).unwrap_or_default();
        items
            .iter()
            .filter_map(|t| {
                let f = t.get("function")?;
                let name = f.get("name")?.as_str()?.to_string();
                let props = f.pointer("/parameters/properties").and_then(Value::as_object);
                let params = props
                    .into_iter()
                    .flatten()
                    .filter_map(|(k, schema)| {
                        // "type": "integer", or a list such as ["integer", "null"].
                        let ty = match schema.get("type")? {
                            Value::String(s) => s.clone(),
                            Value::Array(a) => a.iter().filter_map(Value::as_str).find(|t| *t != "null")?.to_string(),
                            _ => return None,
                        };
                        Some((k.clone(), ty))
                    })
                    .collect();
                Some(Tool { name, params })
            })
            .collect()
    }

    fn param_type(&self, name: &str) -> Option<&str> {
        self.params.iter().find(|(k, _)| k == name).map(|(_, t)| t.as_str())
    }
}

/// A call the reply made: OpenAI's `{"id", "type": "function", "function": {"name", "arguments"}}`
/// with the arguments as JSON text.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

impl ToolCall {
    /// The call as a response's `tool_calls` entry (`index` where it streams).
    pub fn json(&self, index: Option<usize>) -> Value {
        let mut v = serde_json::json!({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}});
        if let Some(i) = index {
            v["index"] = i.into();
        }
        v
    }
}

/// What the reader gives out as the reply comes in.
#[derive(Clone, Debug, PartialEq)]
pub enum Out {
    Text(String),
    Call(ToolCall),
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Reads tool calls out of a reply given in pieces.
pub struct ToolCallReader {
    tools: Vec<Tool>,
    /// Text not given out yet: after a block's opening, up to its close; else a tail that may
    /// be the start of an opening.
    held: String,
    in_block: bool,
    /// Whitespace at the end of the text given out so far, held until it is known whether a
    /// call follows it (then it is left out).
    space: String,
    /// Calls made so far, and the ids' stem.
    calls: usize,
    id_stem: String,
}

impl ToolCallReader {
    /// `id_stem`: what the calls' ids start with (unique to the request and choice).
    pub fn new(tools: Vec<Tool>, id_stem: String) -> ToolCallReader {
        ToolCallReader { tools, held: String::new(), in_block: false, space: String::new(), calls: 0, id_stem }
    }

    /// Add reply text; returns what became certain.
    pub fn push(&mut self, text: &str) -> Vec<Out> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_block {
                let Some(end) = self.held.find(CLOSE) else { break };
                let block: String = self.held.drain(..end + CLOSE.len()).collect();
                self.in_block = false;
                let inner = &block[..end];
                match self.parse(inner) {
                    Some(call) => {
                        // The whitespace before a call is not content.
                        self.space.clear();
                        out.push(Out::Call(call));
                    }
                    None => self.text(&format!("{OPEN}{block}"), &mut out),
                }
            } else if let Some(start) = self.held.find(OPEN) {
                let before: String = self.held.drain(..start + OPEN.len()).collect();
                self.text(&before[..start], &mut out);
                self.in_block = true;
            } else {
                // Keep a tail that could still become an opening.
                let keep = (1..OPEN.len()).rev().find(|&n| self.held.ends_with(&OPEN[..n])).unwrap_or(0);
                let ready: String = self.held.drain(..self.held.len() - keep).collect();
                self.text(&ready, &mut out);
                break;
            }
        }
        out
    }

    /// The reply has ended: what is still held, as text (a block never closed included); the
    /// whitespace after the last call is left out.
    pub fn finish(&mut self) -> Vec<Out> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.held);
        let rest = if std::mem::take(&mut self.in_block) { format!("{OPEN}{rest}") } else { rest };
        self.text(&rest, &mut out);
        if self.calls == 0 && !self.space.is_empty() {
            out.push(Out::Text(std::mem::take(&mut self.space)));
        }
        out
    }

    /// Give out `text` as content, holding back its trailing whitespace.
    fn text(&mut self, text: &str, out: &mut Vec<Out>) {
        if text.is_empty() {
            return;
        }
        let body = text.trim_end();
        if body.is_empty() {
            self.space.push_str(text);
            return;
        }
        let mut s = std::mem::take(&mut self.space);
        s.push_str(body);
        self.space = text[body.len()..].to_string();
        out.push(Out::Text(s));
    }

    /// A block's inside (`<function=NAME>` ... `</function>`) as a call, or None where it does
    /// not parse or names no function of the request.
    fn parse(&mut self, inner: &str) -> Option<ToolCall> {
        let rest = inner.trim().strip_prefix("<function=")?;
        let (name, rest) = rest.split_once('>')?;
        let tool = self.tools.iter().find(|t| t.name == name.trim())?;
        let mut body = rest.trim_end().strip_suffix("</function>")?;
        let mut args = Map::new();
        loop {
            body = body.trim_start();
            if body.is_empty() {
                break;
            }
            let r = body.strip_prefix("<parameter=")?;
            let (param, r) = r.split_once('>')?;
            let (value, r) = r.split_once("</parameter>")?;
            // The template writes each value between two newlines.
            let value = value.strip_prefix('\n').unwrap_or(value);
            let value = value.strip_suffix('\n').unwrap_or(value);
            let param = param.trim();
            args.insert(param.to_string(), typed(value, tool.param_type(param)));
            body = r;
        }
        let call = ToolCall { id: format!("{}_{}", self.id_stem, self.calls), name: tool.name.clone(), arguments: Value::Object(args).to_string() };
        self.calls += 1;
        Some(call)
    }
}

/// A parameter's text as the JSON value its schema type says: a string as it is; other types
/// read as JSON (a boolean also in any case), kept as a string where they do not read. Without
/// a type, JSON where the text is JSON, else a string.
fn typed(text: &str, ty: Option<&str>) -> Value {
    let json = || serde_json::from_str::<Value>(text.trim()).ok();
    let string = || Value::String(text.to_string());
    match ty {
        Some("string") => string(),
        Some("boolean") => match text.trim().to_ascii_lowercase().as_str() {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ => string(),
        },
        Some("integer") => json().filter(|v| v.is_i64() || v.is_u64()).unwrap_or_else(string),
        Some("number") => json().filter(Value::is_number).unwrap_or_else(string),
        Some("object") => json().filter(Value::is_object).unwrap_or_else(string),
        Some("array") => json().filter(Value::is_array).unwrap_or_else(string),
        _ => json().unwrap_or_else(string),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The content and calls of a whole reply read in one piece.
    fn read_whole(tools: Vec<Tool>, id_stem: String, reply: &str) -> (String, Vec<ToolCall>) {
        let mut r = ToolCallReader::new(tools, id_stem);
        let mut outs = r.push(reply);
        outs.extend(r.finish());
        let (mut content, mut calls) = (String::new(), Vec::new());
        for o in outs {
            match o {
                Out::Text(t) => content.push_str(&t),
                Out::Call(c) => calls.push(c),
            }
        }
        (content, calls)
    }


    fn tools() -> Vec<Tool> {
        let v: Value = serde_json::from_str(
            r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}, "hours": {"type": ["array", "null"]}, "scale": {"type": "number"}}}}},
               {"type": "function", "function": {"name": "now"}}]"#,
        )
        .unwrap();
        Tool::list(&v)
    }

    /// A call as the Qwen3.5 template writes one (and the model is trained to).
    const CALL: &str = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n</function>\n</tool_call>";

    #[test]
    fn calls_in_the_template_format_are_read_with_typed_arguments() {
        let reply = format!("I will look it up.\n\n{CALL}\n<tool_call>\n<function=now>\n</function>\n</tool_call>");
        let (content, calls) = read_whole(tools(), "call_x".into(), &reply);
        assert_eq!(content, "I will look it up.");
        assert_eq!(calls.len(), 2);
        assert_eq!((calls[0].id.as_str(), calls[0].name.as_str()), ("call_x_0", "get_weather"));
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(args, serde_json::json!({"city": "New York", "days": 3, "metric": true, "hours": [9, 12], "scale": 1.5}));
        assert_eq!((calls[1].name.as_str(), calls[1].arguments.as_str(), calls[1].id.as_str()), ("now", "{}", "call_x_1"));
        // A value that does not read as its type stays a string; a multi-line string keeps its
        // inner newlines.
        let odd = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=city>\nline one\nline two\n</parameter>\n</function>\n</tool_call>";
        let (_, calls) = read_whole(tools(), "c".into(), odd);
        assert_eq!(serde_json::from_str::<Value>(&calls[0].arguments).unwrap(), serde_json::json!({"days": "three", "city": "line one\nline two"}));
    }

    #[test]
    fn malformed_calls_come_back_as_text() {
        for bad in [
            "<tool_call>\n<function=unknown_tool>\n</function>\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
            "<tool_call><tool_call></tool_call>",
        ] {
            let reply = format!("Sure.\n{bad}");
            let (content, calls) = read_whole(tools(), "c".into(), &reply);
            assert!(calls.is_empty(), "{bad:?}: {calls:?}");
            assert_eq!(content, reply, "{bad:?}");
        }
        // Plain text passes unchanged, trailing whitespace and a lone '<' included.
        assert_eq!(read_whole(tools(), "c".into(), "a < b <tool_ca\n\n").0, "a < b <tool_ca\n\n");
    }

    #[test]
    fn a_reply_read_in_any_pieces_gives_what_the_whole_gives() {
        let reply = format!("Let me check.\n\n{CALL}\ntrailing words <tool_call>\n<function=bogus>\n</function>\n</tool_call>\n{CALL}\n");
        let whole = read_whole(tools(), "c".into(), &reply);
        assert_eq!(whole.1.len(), 2);
        assert!(whole.0.starts_with("Let me check.\ntrailing words <tool_call>\n<function=bogus>"), "{:?}", whole.0);
        for size in [1, 2, 3, 5, 7, 11, 64] {
            let mut r = ToolCallReader::new(tools(), "c".into());
            let chars: Vec<char> = reply.chars().collect();
            let mut outs = Vec::new();
            for piece in chars.chunks(size) {
                outs.extend(r.push(&piece.iter().collect::<String>()));
            }
            outs.extend(r.finish());
            let content: String = outs.iter().filter_map(|o| if let Out::Text(t) = o { Some(t.as_str()) } else { None }).collect();
            let calls: Vec<ToolCall> = outs.iter().filter_map(|o| if let Out::Call(c) = o { Some(c.clone()) } else { None }).collect();
            assert_eq!((content, calls), whole, "pieces of {size}");
        }
    }
}
