//! JSON schemas compiled to a byte-level pushdown automaton, for constrained decoding.
//!
//! [`Grammar::compile`] turns the common subset of JSON Schema (objects with `properties` and
//! `required`, strings with `enum`/`minLength`/`maxLength`, numbers, integers, booleans, null,
//! arrays with `items`/`minItems`/`maxItems`, `enum`, `const`, `anyOf`, `$ref` into `$defs`)
//! into a graph of [`Node`]s; any other keyword is refused by name. [`Machine`] reads bytes of
//! JSON text: a set of stacks of [`Frame`]s (a set because `anyOf` alternatives and number
//! endings are explored side by side), each stack a parse in progress. A byte that no stack
//! accepts is not valid JSON for the schema. [`Machine::min_to_finish`] bounds how many more
//! bytes complete the value, so a token budget can force the JSON to close in time.
//!
//! Generation stays compact and finite: at most [`MAX_WS`] whitespace bytes between tokens,
//! numbers of at most [`MAX_DIGITS`] digits, at most [`MAX_DEPTH`] levels of nesting, and
//! objects with `properties` get only their declared keys (fewer keys than allowed is still
//! valid).

use serde_json::{Map, Value};

/// Whitespace bytes allowed in one gap between JSON tokens.
pub(crate) const MAX_WS: u8 = 8;
/// Digits of a number's integer part, fraction and exponent (each).
pub(crate) const MAX_DIGITS: u8 = 15;
/// Open objects and arrays at once.
pub(crate) const MAX_DEPTH: usize = 24;

/// An error naming the schema location and keyword.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SchemaError {
    /// Where in the schema, as a JSON pointer (`/properties/name/pattern`).
    pub path: String,
    pub message: String,
}

type NodeId = usize;

#[derive(Debug, Clone)]
pub(crate) struct Prop {
    /// The key as JSON text, quotes included.
    key: Vec<u8>,
    value: NodeId,
    required: bool,
}

#[derive(Debug, Clone)]
pub(crate) enum Node {
    /// Declared keys only (`props`), or any keys with values of `free` (no `properties`).
    Object {
        props: Vec<Prop>,
        free: Option<NodeId>,
    },
    Array {
        items: NodeId,
        min: u32,
        max: u32,
    },
    String {
        min: u32,
        max: u32,
    },
    Number {
        integer: bool,
    },
    /// One of these JSON texts exactly (`enum`, `const`, `true`/`false`, `null`).
    Literals(Vec<Vec<u8>>),
    AnyOf(Vec<NodeId>),
    /// A `$ref` not compiled yet (resolved before use).
    Pending,
}

/// A compiled schema.
#[derive(Debug, Clone)]
pub(crate) struct Grammar {
    nodes: Vec<Node>,
    root: NodeId,
    /// Fewest bytes of JSON text a value of each node takes.
    min_len: Vec<usize>,
}

/// Keywords that describe and do not constrain.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "strict",
];

struct Compiler<'a> {
    root_schema: &'a Value,
    nodes: Vec<Node>,
    /// `$ref` targets compiled (or being compiled), by reference text.
    refs: Vec<(String, NodeId)>,
}

impl Grammar {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    pub fn any_object() -> Grammar {
        Grammar::compile(&serde_json::json!({"type": "object"}))
            .unwrap_or_else(|_| unreachable!("the object schema compiles"))
    }

    /// Compiles `schema`; an unsupported keyword or a malformed value is an error naming it.
    pub fn compile(schema: &Value) -> Result<Grammar, SchemaError> {
        let mut c = Compiler {
            root_schema: schema,
            nodes: Vec::new(),
            refs: Vec::new(),
        };
        let root = c.node(schema, "")?;
        let mut g = Grammar {
            nodes: c.nodes,
            root,
            min_len: Vec::new(),
        };
        g.min_len = g.compute_min_len();
        if g.min_len[root] >= UNREACHABLE {
            return Err(SchemaError {
                path: String::new(),
                message: "the schema admits no finite JSON value".into(),
            });
        }
        Ok(g)
    }

    /// Fixed point of each node's shortest JSON text (recursive schemas converge from above).
    fn compute_min_len(&self) -> Vec<usize> {
        let mut len = vec![UNREACHABLE; self.nodes.len()];
        loop {
            let mut changed = false;
            for (i, node) in self.nodes.iter().enumerate() {
                let add = |a: usize, b: usize| a.saturating_add(b).min(UNREACHABLE);
                let l = match node {
                    Node::Object { props, .. } => {
                        let required: Vec<&Prop> = props.iter().filter(|p| p.required).collect();
                        let body = required
                            .iter()
                            .map(|p| add(p.key.len() + 1, len[p.value]))
                            .fold(0, add);
                        add(2 + required.len().saturating_sub(1), body)
                    }
                    Node::Array { items, min, .. } => {
                        let n = *min as usize;
                        add(
                            2 + n.saturating_sub(1),
                            len[*items].saturating_mul(n).min(UNREACHABLE),
                        )
                    }
                    Node::String { min, .. } => 2 + *min as usize,
                    Node::Number { .. } => 1,
                    Node::Literals(l) => l.iter().map(Vec::len).min().unwrap_or(UNREACHABLE),
                    Node::AnyOf(options) => {
                        options.iter().map(|o| len[*o]).min().unwrap_or(UNREACHABLE)
                    }
                    Node::Pending => UNREACHABLE,
                };
                if l < len[i] {
                    len[i] = l;
                    changed = true;
                }
            }
            if !changed {
                return len;
            }
        }
    }

    /// A machine at the start of a value.
    pub fn start(&self) -> Machine {
        Machine {
            stacks: vec![vec![Frame::Value {
                node: self.root,
                ws: 0,
            }]],
        }
    }
}

/// Larger than any real length.
const UNREACHABLE: usize = usize::MAX / 4;

impl Compiler<'_> {
    fn push(&mut self, node: Node) -> NodeId {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    fn node(&mut self, schema: &Value, path: &str) -> Result<NodeId, SchemaError> {
        let err = |key: &str, message: String| SchemaError {
            path: format!("{path}/{key}"),
            message,
        };
        let obj = match schema {
            Value::Bool(true) => return Ok(self.any(path)),
            Value::Object(o) => o,
            _ => {
                return Err(SchemaError {
                    path: path.to_string(),
                    message: "a schema must be an object (or `true`)".into(),
                })
            }
        };
        if let Some(r) = obj.get("$ref") {
            return self.reference(r, path);
        }
        for key in obj.keys() {
            let known = ANNOTATIONS.contains(&key.as_str())
                || matches!(
                    key.as_str(),
                    "type"
                        | "properties"
                        | "required"
                        | "additionalProperties"
                        | "items"
                        | "minItems"
                        | "maxItems"
                        | "minLength"
                        | "maxLength"
                        | "enum"
                        | "const"
                        | "anyOf"
                        | "$defs"
                        | "definitions"
                );
            if !known {
                return Err(err(
                    key,
                    format!(
                        "the JSON-schema keyword `{key}` is not supported for constrained output"
                    ),
                ));
            }
        }
        if let Some(values) = obj.get("enum").or_else(|| obj.get("const").map(|_| schema)) {
            let list: Vec<&Value> = match (obj.get("const"), values) {
                (Some(c), _) => vec![c],
                (None, Value::Array(items)) if !items.is_empty() => items.iter().collect(),
                _ => return Err(err("enum", "`enum` must be a non-empty list".into())),
            };
            let mut texts = Vec::new();
            for v in list {
                if !type_allows(obj.get("type"), v) {
                    continue;
                }
                let text = serde_json::to_vec(v).map_err(|e| err("enum", e.to_string()))?;
                if !texts.contains(&text) {
                    texts.push(text);
                }
            }
            if texts.is_empty() {
                return Err(err(
                    "enum",
                    "no value of `enum`/`const` matches `type`".into(),
                ));
            }
            return Ok(self.push(Node::Literals(texts)));
        }
        if let Some(any) = obj.get("anyOf") {
            let Some(items) = any.as_array().filter(|a| !a.is_empty()) else {
                return Err(err(
                    "anyOf",
                    "`anyOf` must be a non-empty list of schemas".into(),
                ));
            };
            if obj.contains_key("type") {
                return Err(err(
                    "anyOf",
                    "`anyOf` next to `type` is not supported: put the type in each alternative"
                        .into(),
                ));
            }
            let id = self.push(Node::Pending);
            let mut options = Vec::new();
            for (i, s) in items.iter().enumerate() {
                options.push(self.node(s, &format!("{path}/anyOf/{i}"))?);
            }
            self.nodes[id] = Node::AnyOf(options);
            return Ok(id);
        }
        let types: Vec<&str> = match obj.get("type") {
            None => return Ok(self.any(path)),
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(list)) if !list.is_empty() => list
                .iter()
                .map(|t| {
                    t.as_str()
                        .ok_or_else(|| err("type", "`type` entries must be strings".into()))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => {
                return Err(err(
                    "type",
                    "`type` must be a string or a list of them".into(),
                ))
            }
        };
        let mut options = Vec::new();
        for t in types {
            let node = match t {
                "object" => self.object(obj, path)?,
                "array" => {
                    let id = self.push(Node::Pending);
                    let items = match obj.get("items") {
                        None => self.any(path),
                        Some(s) => self.node(s, &format!("{path}/items"))?,
                    };
                    let min = count(obj, "minItems", path)?.unwrap_or(0);
                    let max = count(obj, "maxItems", path)?.unwrap_or(u32::MAX);
                    if min > max {
                        return Err(err("minItems", "`minItems` exceeds `maxItems`".into()));
                    }
                    self.nodes[id] = Node::Array { items, min, max };
                    id
                }
                "string" => {
                    let min = count(obj, "minLength", path)?.unwrap_or(0);
                    let max = count(obj, "maxLength", path)?.unwrap_or(u32::MAX);
                    if min > max {
                        return Err(err("minLength", "`minLength` exceeds `maxLength`".into()));
                    }
                    self.push(Node::String { min, max })
                }
                "number" => self.push(Node::Number { integer: false }),
                "integer" => self.push(Node::Number { integer: true }),
                "boolean" => self.push(Node::Literals(vec![b"true".to_vec(), b"false".to_vec()])),
                "null" => self.push(Node::Literals(vec![b"null".to_vec()])),
                other => return Err(err("type", format!("unknown type `{other}`"))),
            };
            options.push(node);
        }
        Ok(if options.len() == 1 {
            options[0]
        } else {
            self.push(Node::AnyOf(options))
        })
    }

    fn object(&mut self, obj: &Map<String, Value>, path: &str) -> Result<NodeId, SchemaError> {
        let err = |key: &str, message: &str| SchemaError {
            path: format!("{path}/{key}"),
            message: message.into(),
        };
        let id = self.push(Node::Pending);
        let required: Vec<&str> = match obj.get("required") {
            None => Vec::new(),
            Some(Value::Array(r)) => r
                .iter()
                .map(|v| {
                    v.as_str()
                        .ok_or_else(|| err("required", "`required` must list strings"))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(err("required", "`required` must be a list of strings")),
        };
        let node = match obj.get("properties") {
            Some(Value::Object(props)) => {
                if props.len() > 64 {
                    return Err(err(
                        "properties",
                        "at most 64 properties per object are supported",
                    ));
                }
                for r in &required {
                    if !props.contains_key(*r) {
                        return Err(err(
                            "required",
                            &format!("`{r}` is required but not among `properties`"),
                        ));
                    }
                }
                let mut list = Vec::new();
                for (key, schema) in props {
                    let value = self.node(schema, &format!("{path}/properties/{key}"))?;
                    list.push(Prop {
                        key: serde_json::to_vec(key).unwrap_or_default(),
                        value,
                        required: required.contains(&key.as_str()),
                    });
                }
                Node::Object {
                    props: list,
                    free: None,
                }
            }
            Some(_) => return Err(err("properties", "`properties` must be an object")),
            None => {
                if !required.is_empty() {
                    return Err(err("required", "`required` needs `properties`"));
                }
                let free = match obj.get("additionalProperties") {
                    None | Some(Value::Bool(true)) => Some(self.any(path)),
                    Some(Value::Bool(false)) => None,
                    Some(s) => Some(self.node(s, &format!("{path}/additionalProperties"))?),
                };
                Node::Object {
                    props: Vec::new(),
                    free,
                }
            }
        };
        self.nodes[id] = node;
        Ok(id)
    }

    /// Any JSON value (one node per grammar, shared).
    fn any(&mut self, _path: &str) -> NodeId {
        if let Some((_, id)) = self.refs.iter().find(|(r, _)| r == "<any>") {
            return *id;
        }
        let id = self.push(Node::Pending);
        self.refs.push(("<any>".into(), id));
        let object = self.push(Node::Object {
            props: Vec::new(),
            free: Some(id),
        });
        let array = self.push(Node::Array {
            items: id,
            min: 0,
            max: u32::MAX,
        });
        let string = self.push(Node::String {
            min: 0,
            max: u32::MAX,
        });
        let number = self.push(Node::Number { integer: false });
        let literals = self.push(Node::Literals(vec![
            b"true".to_vec(),
            b"false".to_vec(),
            b"null".to_vec(),
        ]));
        self.nodes[id] = Node::AnyOf(vec![object, array, string, number, literals]);
        id
    }

    /// `$ref` to `#`, `#/$defs/NAME` or `#/definitions/NAME`.
    fn reference(&mut self, r: &Value, path: &str) -> Result<NodeId, SchemaError> {
        let err = |message: String| SchemaError {
            path: format!("{path}/$ref"),
            message,
        };
        let Some(text) = r.as_str() else {
            return Err(err("`$ref` must be a string".into()));
        };
        if let Some((_, id)) = self.refs.iter().find(|(t, _)| t == text) {
            return Ok(*id);
        }
        let Some(pointer) = text.strip_prefix('#') else {
            return Err(err(format!(
                "only local references (`#/$defs/...`) are supported, not `{text}`"
            )));
        };
        let target = self
            .root_schema
            .pointer(pointer)
            .ok_or_else(|| err(format!("`{text}` points to nothing in the schema")))?;
        // Registered before compiling, so a recursive reference finds it.
        let id = self.push(Node::Pending);
        self.refs.push((text.to_string(), id));
        let inner = self.node(target, pointer)?;
        self.nodes[id] = Node::AnyOf(vec![inner]);
        Ok(id)
    }
}

fn count(obj: &Map<String, Value>, key: &str, path: &str) -> Result<Option<u32>, SchemaError> {
    match obj.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| SchemaError {
                path: format!("{path}/{key}"),
                message: format!("`{key}` must be a non-negative integer"),
            }),
    }
}

/// Whether an `enum` value fits the schema's `type` (when there is one).
fn type_allows(ty: Option<&Value>, v: &Value) -> bool {
    let fits = |t: &str| match t {
        "string" => v.is_string(),
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        _ => false,
    };
    match ty {
        None => true,
        Some(Value::String(t)) => fits(t),
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).any(fits),
        Some(_) => false,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum NumPhase {
    /// After `-`: a digit is due.
    Sign,
    /// After a leading `0`.
    Zero,
    Int,
    /// After `.`: a digit is due.
    Dot,
    Frac,
    /// After `e`: a sign or digit is due.
    E,
    /// After `e+`/`e-`: a digit is due.
    ESign,
    Exp,
}

impl NumPhase {
    fn complete(self) -> bool {
        matches!(
            self,
            NumPhase::Zero | NumPhase::Int | NumPhase::Frac | NumPhase::Exp
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Esc {
    None,
    /// After `\`.
    Start,
    /// Hex digits of `\uXXXX` still due.
    Hex(u8),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum ObjState {
    /// After `{`: a key or `}`.
    First,
    /// After `,`: a key.
    Key,
    /// A key is being read (a frame above).
    InKey,
    /// After the key of prop (`FREE`: a free key): `:` is due.
    Colon(u16),
    /// The value is being read (a frame above).
    InValue,
    /// After a value: `,` or `}`.
    After,
}

/// The prop index of a free (undeclared) key.
const FREE: u16 = u16::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum ArrState {
    First,
    InValue,
    After,
}

/// One level of a parse in progress.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Frame {
    /// A value of `node` is due, after `ws` whitespace bytes so far.
    Value { node: NodeId, ws: u8 },
    /// Inside one of `node`'s literals: those in `alive` match the `pos` bytes read.
    Lit {
        node: NodeId,
        alive: Vec<u16>,
        pos: u16,
    },
    /// Inside a string (the opening quote read); `len` characters so far.
    Str {
        min: u32,
        max: u32,
        len: u32,
        esc: Esc,
        cont: u8,
    },
    Num {
        integer: bool,
        phase: NumPhase,
        digits: u8,
    },
    /// Inside an object key of `node`: the unseen props in `alive` match `pos` bytes (the
    /// opening quote is byte 0).
    Key {
        node: NodeId,
        alive: Vec<u16>,
        pos: u16,
    },
    Obj {
        node: NodeId,
        seen: u64,
        state: ObjState,
        ws: u8,
    },
    Arr {
        node: NodeId,
        count: u32,
        state: ArrState,
        ws: u8,
    },
}

type Stack = Vec<Frame>;

/// A parse in progress: every stack that the bytes so far allow (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Machine {
    stacks: Vec<Stack>,
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\t' | b'\r')
}

impl Machine {
    /// Whether the bytes so far are a complete value.
    pub fn is_complete(&self) -> bool {
        self.stacks.iter().any(|s| {
            s.is_empty()
                || (s.len() == 1 && matches!(s[0], Frame::Num { phase, .. } if phase.complete()))
        })
    }

    /// Whether the value is complete and nothing can follow it.
    #[cfg(test)]
    pub fn is_closed(&self) -> bool {
        self.stacks.iter().all(Vec::is_empty)
    }

    /// Reads `bytes`; `false` (and a dead machine) when they cannot continue the value.
    pub fn feed(&mut self, g: &Grammar, bytes: &[u8]) -> bool {
        for &b in bytes {
            let mut next = Vec::new();
            for stack in std::mem::take(&mut self.stacks) {
                step(g, stack, b, &mut next);
            }
            next.dedup();
            if next.len() > 1 {
                let mut unique: Vec<Stack> = Vec::with_capacity(next.len());
                for s in next {
                    if !unique.contains(&s) {
                        unique.push(s);
                    }
                }
                next = unique;
            }
            self.stacks = next;
            if self.stacks.is_empty() {
                return false;
            }
        }
        true
    }

    /// Fewest bytes that complete the value from here (an upper bound's worth of care: never
    /// less than the truth, so a budget kept by it is always enough).
    pub fn min_to_finish(&self, g: &Grammar) -> usize {
        self.stacks
            .iter()
            .map(|s| stack_min(g, s))
            .min()
            .unwrap_or(UNREACHABLE)
    }
}

/// Bytes to finish one stack exactly: each frame's own rest, innermost first. Exactness
/// matters: following the cheapest byte must lower the count by one, or a budget kept by it
/// could lead to a state with no allowed token.
fn stack_min(g: &Grammar, stack: &[Frame]) -> usize {
    let add = |a: usize, b: usize| a.saturating_add(b).min(UNREACHABLE);
    let mut total = 0usize;
    let mut depth = stack.len();
    while depth > 0 {
        depth -= 1;
        let own = match &stack[depth] {
            Frame::Value { node, .. } => g.min_len[*node],
            Frame::Lit { node, alive, pos } => match &g.nodes[*node] {
                Node::Literals(l) => alive
                    .iter()
                    .map(|i| l[*i as usize].len() - *pos as usize)
                    .min()
                    .unwrap_or(UNREACHABLE),
                _ => UNREACHABLE,
            },
            Frame::Str {
                min,
                len,
                esc,
                cont,
                ..
            } => {
                let (esc_bytes, pending_char) = match esc {
                    Esc::None => (0, 0),
                    Esc::Start => (1, 1),
                    Esc::Hex(n) => (*n as usize, 1),
                };
                let chars = (*min as usize).saturating_sub(*len as usize + pending_char);
                *cont as usize + esc_bytes + chars + 1
            }
            Frame::Num { phase, .. } => usize::from(!phase.complete()),
            // A declared key and its value, then what its object still needs without it (the
            // object frame below is counted here and skipped).
            Frame::Key { node, alive, pos } => {
                let Some(Frame::Obj { seen, .. }) = depth.checked_sub(1).map(|d| &stack[d]) else {
                    return UNREACHABLE;
                };
                let Node::Object { props, .. } = &g.nodes[*node] else {
                    return UNREACHABLE;
                };
                depth -= 1;
                alive
                    .iter()
                    .map(|i| {
                        let p = &props[*i as usize];
                        let rest = object_after(g, props, seen | (1 << i));
                        add(p.key.len() - *pos as usize + 1 + g.min_len[p.value], rest)
                    })
                    .min()
                    .unwrap_or(UNREACHABLE)
            }
            Frame::Obj {
                node, seen, state, ..
            } => {
                let Node::Object { props, free } = &g.nodes[*node] else {
                    return UNREACHABLE;
                };
                let free_len = free.map_or(UNREACHABLE, |f| g.min_len[f]);
                let missing: Vec<&Prop> = props
                    .iter()
                    .enumerate()
                    .filter(|(i, p)| p.required && seen & (1 << i) == 0)
                    .map(|(_, p)| p)
                    .collect();
                let cost = |p: &Prop| p.key.len() + 1 + g.min_len[p.value];
                // The missing props, comma-separated, then `}`.
                let first_keys = missing.iter().map(|p| cost(p)).fold(0, add)
                    + missing.len().saturating_sub(1)
                    + 1;
                match state {
                    ObjState::First if missing.is_empty() => 1,
                    ObjState::First => first_keys,
                    // After a comma some key must come.
                    ObjState::Key if missing.is_empty() => {
                        let declared = props
                            .iter()
                            .enumerate()
                            .filter(|(i, _)| seen & (1 << i) == 0)
                            .map(|(_, p)| cost(p))
                            .min()
                            .unwrap_or(UNREACHABLE);
                        add(declared.min(add(3, free_len)), 1)
                    }
                    ObjState::Key => first_keys,
                    // A free key is being read (a declared one is counted by its Key frame).
                    ObjState::InKey => add(1 + free_len, object_after(g, props, *seen)),
                    ObjState::Colon(p) => {
                        let value = match *p {
                            FREE => free_len,
                            i => g.min_len[props[i as usize].value],
                        };
                        add(1 + value, object_after(g, props, *seen))
                    }
                    ObjState::InValue | ObjState::After => object_after(g, props, *seen),
                }
            }
            Frame::Arr {
                node, count, state, ..
            } => {
                let Node::Array { items, min, .. } = &g.nodes[*node] else {
                    return UNREACHABLE;
                };
                let item = g.min_len[*items];
                match state {
                    ArrState::First if *min == 0 => 1,
                    ArrState::First => add(
                        item.saturating_mul(*min as usize).min(UNREACHABLE),
                        *min as usize,
                    ),
                    ArrState::InValue | ArrState::After => {
                        let done = *count + u32::from(*state == ArrState::InValue);
                        let need = min.saturating_sub(done) as usize;
                        add(need.saturating_mul(item + 1).min(UNREACHABLE), 1)
                    }
                }
            }
        };
        total = add(total, own);
    }
    total
}

/// Bytes an object still needs after a value, with the props in `seen` done: `,` and each
/// missing required prop, then `}`.
fn object_after(g: &Grammar, props: &[Prop], seen: u64) -> usize {
    props
        .iter()
        .enumerate()
        .filter(|(i, p)| p.required && seen & (1 << i) == 0)
        .map(|(_, p)| 1 + p.key.len() + 1 + g.min_len[p.value])
        .fold(1usize, |a, b| a.saturating_add(b).min(UNREACHABLE))
}

/// Follows `b` from `stack`, pushing every resulting stack to `out`.
fn step(g: &Grammar, mut stack: Stack, b: u8, out: &mut Vec<Stack>) {
    let Some(top) = stack.pop() else {
        // A finished value: nothing may follow.
        return;
    };
    match top {
        Frame::Value { node, ws } => {
            if is_ws(b) {
                if ws < MAX_WS {
                    stack.push(Frame::Value { node, ws: ws + 1 });
                    out.push(stack);
                }
                return;
            }
            start_value(g, stack, node, b, out);
        }
        Frame::Lit { node, alive, pos } => {
            let Node::Literals(lits) = &g.nodes[node] else {
                return;
            };
            let alive: Vec<u16> = alive
                .into_iter()
                .filter(|i| lits[*i as usize].get(pos as usize) == Some(&b))
                .collect();
            literal_advanced(g, stack, node, lits, alive, pos + 1, out);
        }
        Frame::Str {
            min,
            max,
            len,
            esc,
            cont,
        } => {
            let mut s = (min, max, len, esc, cont);
            let ok = if cont > 0 {
                s.4 = cont - 1;
                (0x80..=0xBF).contains(&b)
            } else {
                match esc {
                    Esc::Start => match b {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                            s.3 = Esc::None;
                            s.2 += 1;
                            true
                        }
                        b'u' => {
                            s.3 = Esc::Hex(4);
                            true
                        }
                        _ => false,
                    },
                    Esc::Hex(n) => {
                        if b.is_ascii_hexdigit() {
                            if n == 1 {
                                s.3 = Esc::None;
                                s.2 += 1;
                            } else {
                                s.3 = Esc::Hex(n - 1);
                            }
                            true
                        } else {
                            false
                        }
                    }
                    Esc::None => match b {
                        b'"' => {
                            if len >= min {
                                complete(g, stack, None, out);
                            }
                            return;
                        }
                        b'\\' => {
                            s.3 = Esc::Start;
                            len < max
                        }
                        0x00..=0x1F | 0x7F => false,
                        0x20..=0x7E => {
                            s.2 += 1;
                            true
                        }
                        0xC2..=0xF4 => {
                            s.4 = if b >= 0xF0 {
                                3
                            } else if b >= 0xE0 {
                                2
                            } else {
                                1
                            };
                            s.2 += 1;
                            true
                        }
                        _ => false,
                    },
                }
            };
            if ok && s.2 <= max {
                // Without a maximum, lengths past the minimum behave alike: one state for
                // them keeps the states of a long string equal (the mask cache hits).
                let len = if max == u32::MAX { s.2.min(min) } else { s.2 };
                stack.push(Frame::Str {
                    min: s.0,
                    max: s.1,
                    len,
                    esc: s.3,
                    cont: s.4,
                });
                out.push(stack);
            }
        }
        Frame::Num {
            integer,
            phase,
            digits,
        } => {
            let digit = b.is_ascii_digit();
            let next = match (phase, b) {
                (NumPhase::Sign, b'0') => Some((NumPhase::Zero, 1)),
                (NumPhase::Sign, _) if digit => Some((NumPhase::Int, 1)),
                (NumPhase::Int, _) if digit && digits < MAX_DIGITS => {
                    Some((NumPhase::Int, digits + 1))
                }
                (NumPhase::Zero | NumPhase::Int, b'.') if !integer => Some((NumPhase::Dot, 0)),
                (NumPhase::Zero | NumPhase::Int | NumPhase::Frac, b'e' | b'E') if !integer => {
                    Some((NumPhase::E, 0))
                }
                (NumPhase::Dot, _) if digit => Some((NumPhase::Frac, 1)),
                (NumPhase::Frac, _) if digit && digits < MAX_DIGITS => {
                    Some((NumPhase::Frac, digits + 1))
                }
                (NumPhase::E, b'+' | b'-') => Some((NumPhase::ESign, 0)),
                (NumPhase::E | NumPhase::ESign, _) if digit => Some((NumPhase::Exp, 1)),
                (NumPhase::Exp, _) if digit && digits < 3 => Some((NumPhase::Exp, digits + 1)),
                _ => None,
            };
            match next {
                Some((phase, digits)) => {
                    stack.push(Frame::Num {
                        integer,
                        phase,
                        digits,
                    });
                    out.push(stack);
                }
                // The number ends here; the byte belongs to what encloses it.
                None if phase.complete() && !stack.is_empty() => {
                    let mut done = Vec::new();
                    complete(g, stack, None, &mut done);
                    for s in done {
                        step(g, s, b, out);
                    }
                }
                None => {}
            }
        }
        Frame::Key { node, alive, pos } => {
            let Node::Object { props, .. } = &g.nodes[node] else {
                return;
            };
            let alive: Vec<u16> = alive
                .into_iter()
                .filter(|i| props[*i as usize].key.get(pos as usize) == Some(&b))
                .collect();
            let pos = pos + 1;
            if let Some(&done) = alive
                .iter()
                .find(|i| props[**i as usize].key.len() == pos as usize)
            {
                complete(g, stack, Some(done), out);
            } else if !alive.is_empty() {
                stack.push(Frame::Key { node, alive, pos });
                out.push(stack);
            }
        }
        Frame::Obj {
            node,
            seen,
            state,
            ws,
        } => {
            let Node::Object { props, free } = &g.nodes[node] else {
                return;
            };
            let again = |state, ws| Frame::Obj {
                node,
                seen,
                state,
                ws,
            };
            let required_done = props
                .iter()
                .enumerate()
                .all(|(i, p)| !p.required || seen & (1 << i) != 0);
            match (state, b) {
                (ObjState::First | ObjState::Key | ObjState::Colon(_) | ObjState::After, _)
                    if is_ws(b) && ws < MAX_WS =>
                {
                    stack.push(again(state, ws + 1));
                    out.push(stack);
                }
                (ObjState::First | ObjState::After, b'}') if required_done => {
                    complete(g, stack, None, out);
                }
                (ObjState::After, b',') => {
                    let unseen = (0..props.len()).any(|i| seen & (1 << i) == 0);
                    if unseen || free.is_some() {
                        stack.push(again(ObjState::Key, 0));
                        out.push(stack);
                    }
                }
                (ObjState::First | ObjState::Key, b'"') => {
                    let alive: Vec<u16> = (0..props.len() as u16)
                        .filter(|i| seen & (1 << i) == 0)
                        .collect();
                    if !alive.is_empty() {
                        let mut s = stack.clone();
                        s.push(again(ObjState::InKey, 0));
                        s.push(Frame::Key {
                            node,
                            alive,
                            pos: 1,
                        });
                        out.push(s);
                    }
                    if free.is_some() {
                        stack.push(again(ObjState::InKey, 0));
                        stack.push(Frame::Str {
                            min: 0,
                            max: u32::MAX,
                            len: 0,
                            esc: Esc::None,
                            cont: 0,
                        });
                        out.push(stack);
                    }
                }
                (ObjState::Colon(p), b':') => {
                    let value = match p {
                        FREE => match free {
                            Some(f) => *f,
                            None => return,
                        },
                        i => props[i as usize].value,
                    };
                    stack.push(again(ObjState::InValue, 0));
                    stack.push(Frame::Value { node: value, ws: 0 });
                    out.push(stack);
                }
                _ => {}
            }
        }
        Frame::Arr {
            node,
            count,
            state,
            ws,
        } => {
            let Node::Array { items, min, max } = &g.nodes[node] else {
                return;
            };
            let again = |count, state, ws| Frame::Arr {
                node,
                count,
                state,
                ws,
            };
            match (state, b) {
                (ArrState::First | ArrState::After, _) if is_ws(b) && ws < MAX_WS => {
                    stack.push(again(count, state, ws + 1));
                    out.push(stack);
                }
                (ArrState::First | ArrState::After, b']') if count >= *min => {
                    complete(g, stack, None, out);
                }
                (ArrState::After, b',') if count < *max => {
                    stack.push(again(count, ArrState::InValue, 0));
                    stack.push(Frame::Value {
                        node: *items,
                        ws: 0,
                    });
                    out.push(stack);
                }
                (ArrState::First, _) if *max > 0 => {
                    stack.push(again(count, ArrState::InValue, 0));
                    if stack.len() < MAX_DEPTH * 2 {
                        start_value(g, stack, *items, b, out);
                    }
                }
                _ => {}
            }
        }
    }
}

/// The first byte `b` of a value of `node` (not whitespace), on top of `stack`.
fn start_value(g: &Grammar, mut stack: Stack, node: NodeId, b: u8, out: &mut Vec<Stack>) {
    let depth = stack
        .iter()
        .filter(|f| matches!(f, Frame::Obj { .. } | Frame::Arr { .. }))
        .count();
    match &g.nodes[node] {
        Node::AnyOf(options) => {
            for o in options {
                start_value(g, stack.clone(), *o, b, out);
            }
        }
        Node::Object { .. } if b == b'{' && depth < MAX_DEPTH => {
            stack.push(Frame::Obj {
                node,
                seen: 0,
                state: ObjState::First,
                ws: 0,
            });
            out.push(stack);
        }
        Node::Array { .. } if b == b'[' && depth < MAX_DEPTH => {
            stack.push(Frame::Arr {
                node,
                count: 0,
                state: ArrState::First,
                ws: 0,
            });
            out.push(stack);
        }
        Node::String { min, max } if b == b'"' => {
            stack.push(Frame::Str {
                min: *min,
                max: *max,
                len: 0,
                esc: Esc::None,
                cont: 0,
            });
            out.push(stack);
        }
        Node::Number { integer } if b == b'-' || b.is_ascii_digit() => {
            let (phase, digits) = match b {
                b'-' => (NumPhase::Sign, 0),
                b'0' => (NumPhase::Zero, 1),
                _ => (NumPhase::Int, 1),
            };
            stack.push(Frame::Num {
                integer: *integer,
                phase,
                digits,
            });
            out.push(stack);
        }
        Node::Literals(lits) => {
            let alive: Vec<u16> = (0..lits.len() as u16)
                .filter(|i| lits[*i as usize].first() == Some(&b))
                .collect();
            literal_advanced(g, stack, node, lits, alive, 1, out);
        }
        _ => {}
    }
}

/// After a literal's byte: finished literals complete the value, longer ones go on.
fn literal_advanced(
    g: &Grammar,
    stack: Stack,
    node: NodeId,
    lits: &[Vec<u8>],
    alive: Vec<u16>,
    pos: u16,
    out: &mut Vec<Stack>,
) {
    let (done, going): (Vec<u16>, Vec<u16>) = alive
        .into_iter()
        .partition(|i| lits[*i as usize].len() == pos as usize);
    if !going.is_empty() {
        let mut s = stack.clone();
        s.push(Frame::Lit {
            node,
            alive: going,
            pos,
        });
        out.push(s);
    }
    if !done.is_empty() {
        complete(g, stack, None, out);
    }
}

/// The frame that was on top of `stack` finished (`key`: the prop it was the key of).
fn complete(g: &Grammar, mut stack: Stack, key: Option<u16>, out: &mut Vec<Stack>) {
    match stack.pop() {
        None => out.push(stack),
        Some(Frame::Obj {
            node,
            seen,
            state: ObjState::InKey,
            ..
        }) => {
            let (seen, p) = match key {
                Some(i) => (seen | (1 << i), i),
                None => (seen, FREE),
            };
            stack.push(Frame::Obj {
                node,
                seen,
                state: ObjState::Colon(p),
                ws: 0,
            });
            out.push(stack);
        }
        Some(Frame::Obj {
            node,
            seen,
            state: ObjState::InValue,
            ..
        }) => {
            stack.push(Frame::Obj {
                node,
                seen,
                state: ObjState::After,
                ws: 0,
            });
            out.push(stack);
        }
        Some(Frame::Arr {
            node,
            count,
            state: ArrState::InValue,
            ..
        }) => {
            // As for string lengths: counts past the minimum of an unbounded array are alike.
            let count = match &g.nodes[node] {
                Node::Array {
                    min, max: u32::MAX, ..
                } => (count + 1).min(*min),
                _ => count + 1,
            };
            stack.push(Frame::Arr {
                node,
                count,
                state: ArrState::After,
                ws: 0,
            });
            out.push(stack);
        }
        Some(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn accepts(schema: &Value, text: &str) -> bool {
        let g = Grammar::compile(schema).expect("compiles");
        let mut m = g.start();
        m.feed(&g, text.as_bytes()) && m.is_complete()
    }

    #[test]
    fn objects_strings_numbers() {
        let s = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 5},
                "age": {"type": "integer"},
                "score": {"type": "number"},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bc"]}, "maxItems": 2},
                "ok": {"type": "boolean"},
                "none": {"type": "null"},
            },
            "required": ["name", "age"],
        });
        assert!(accepts(&s, r#"{"name":"Bob","age":42}"#));
        assert!(accepts(
            &s,
            "{ \"age\": -0, \"name\": \"\\u00e9\\n\" , \"score\": 1.5e-3}"
        ));
        assert!(accepts(
            &s,
            r#"{"name":"é","age":1,"tags":["bc","a"],"ok":false,"none":null}"#
        ));
        assert!(!accepts(&s, r#"{"name":"Bob"}"#), "age is required");
        assert!(!accepts(&s, r#"{"name":"Bobby!","age":1}"#), "maxLength");
        assert!(!accepts(&s, r#"{"name":"B","age":1.5}"#), "integer");
        assert!(!accepts(&s, r#"{"name":"B","age":01}"#), "leading zero");
        assert!(
            !accepts(&s, r#"{"name":"B","age":1,"tags":["a","a","a"]}"#),
            "maxItems"
        );
        assert!(!accepts(&s, r#"{"name":"B","age":1,"tags":["x"]}"#), "enum");
        assert!(
            !accepts(&s, r#"{"name":"B","age":1,"extra":1}"#),
            "undeclared key"
        );
        assert!(
            !accepts(&s, r#"{"name":"B","name":"C","age":1}"#),
            "repeated key"
        );
        assert!(!accepts(&s, r#"{"name":"B","age":1}x"#), "trailing bytes");
        assert!(
            !accepts(&s, "{\"name\":\"a\tb\",\"age\":1}"),
            "raw control character"
        );
    }

    #[test]
    fn any_of_refs_and_free_objects() {
        let s = json!({
            "$defs": {"node": {"type": "object", "properties": {
                "v": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            }, "required": ["v", "next"]}},
            "$ref": "#/$defs/node",
        });
        assert!(accepts(&s, r#"{"v":1,"next":{"v":"x","next":null}}"#));
        assert!(!accepts(&s, r#"{"v":true,"next":null}"#));
        let any = Grammar::any_object();
        let mut m = any.start();
        assert!(m.feed(&any, br#"{"a":[1,{"b":null}],"c":"d","e":-2.5E+3}"#) && m.is_closed());
        let mut m = any.start();
        assert!(!m.feed(&any, b"[1]"), "json_object needs an object");
        // Numbers at the top level end only with the text.
        assert!(accepts(&json!({"type": "number"}), "12.5"));
        assert!(accepts(&json!({"enum": [1, 12, "x"]}), "1"));
        assert!(accepts(&json!({"enum": [1, 12, "x"]}), "12"));
        assert!(!accepts(&json!({"enum": [1, 12, "x"]}), "123"));
    }

    #[test]
    fn unsupported_keywords_are_named() {
        let e = Grammar::compile(
            &json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "x+"}}}),
        )
        .unwrap_err();
        assert_eq!(e.path, "/properties/a/pattern");
        assert!(e.message.contains("`pattern`"), "{}", e.message);
        let e = Grammar::compile(&json!({"oneOf": []})).unwrap_err();
        assert_eq!(e.path, "/oneOf");
        let e = Grammar::compile(&json!({"$ref": "#/$defs/missing"})).unwrap_err();
        assert_eq!(e.path, "/$ref");
        let e = Grammar::compile(&json!({"type": "object", "properties": {}, "required": ["x"]}))
            .unwrap_err();
        assert_eq!(e.path, "/required");
    }

    /// From states reached by several texts, some byte always lowers `min_to_finish` by one,
    /// and following such bytes completes the value in exactly that many bytes.
    #[test]
    fn min_to_finish_is_consistent() {
        let schemas = [
            json!({"type": "object", "properties": {
                "name": {"type": "string", "minLength": 2},
                "n": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["xy", 12, null]}, "minItems": 2},
                "sub": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}]},
            }, "required": ["name", "tags", "sub"]}),
            json!({"type": "object"}),
            json!({"type": "array", "items": {"type": "number"}, "minItems": 1}),
        ];
        let prefixes: [&[&str]; 3] = [
            &[
                "",
                "{",
                "{\"",
                "{\"na",
                "{\"name\"",
                "{\"name\":",
                "{\"name\":\"\\u00",
                "{\"name\":\"é",
                "{\"name\":\"ab\",",
                "{\"tags\":[1",
                "{\"tags\":[12,",
                "{\"sub\":{",
                "{\"n\":-",
            ],
            &["", "{", "{\"k\"", "{\"k\":[", "{\"k\":{\"z\":1"],
            &["", "[", "[1", "[1.", "[1e"],
        ];
        for (schema, texts) in schemas.iter().zip(prefixes) {
            let g = Grammar::compile(schema).unwrap();
            for text in texts {
                let mut m = g.start();
                assert!(m.feed(&g, text.as_bytes()), "{schema} / {text:?}");
                let mut out = text.to_string().into_bytes();
                let mut left = m.min_to_finish(&g);
                let start = left;
                while !(m.is_complete() && left == 0) {
                    let next = (0..=255u8).find_map(|b| {
                        let mut n = m.clone();
                        (n.feed(&g, &[b]) && n.min_to_finish(&g) + 1 == left).then_some((b, n))
                    });
                    let (b, n) = next.unwrap_or_else(|| {
                        panic!(
                            "{schema} / {text:?}: stuck at {:?} with {left} to go",
                            String::from_utf8_lossy(&out)
                        )
                    });
                    out.push(b);
                    m = n;
                    left -= 1;
                }
                let done = String::from_utf8(out).unwrap();
                assert_eq!(done.len(), text.len() + start, "{done}");
                serde_json::from_str::<Value>(&done).unwrap_or_else(|e| panic!("{done}: {e}"));
            }
        }
    }

    #[test]
    fn min_to_finish_is_exact_on_simple_paths() {
        let s = json!({"type": "object", "properties": {"a": {"type": "string", "minLength": 2}}, "required": ["a"]});
        let g = Grammar::compile(&s).unwrap();
        let mut m = g.start();
        // {"a":"xx"} is 10 bytes.
        assert_eq!(m.min_to_finish(&g), 10);
        assert!(m.feed(&g, br#"{"a":"x"#));
        assert_eq!(m.min_to_finish(&g), 3);
        assert!(m.feed(&g, br#"x"}"#));
        assert_eq!(m.min_to_finish(&g), 0);
        assert!(m.is_closed());
    }
}
