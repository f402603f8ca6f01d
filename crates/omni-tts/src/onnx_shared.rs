//! One copy of each integer-product weight per node, so ONNX Runtime's exact int8 path can load
//! the voice.
//!
//! [`crate::onnx::X64_QUANT_PRECISION`] makes ONNX Runtime rewrite every int8 weight of an
//! integer product (`MatMulInteger` and kin) to uint8. ONNX Runtime 1.31 does that per node and
//! fails when two nodes share one weight ("Attempt to replace the existing tensor"), and the
//! hibari graph shares several (its tied layers run 4 to 6 times). [`unshare_integer_weights`]
//! gives every later use its own copy under a new name; the products are unchanged (checked
//! against the unmodified graph: outputs bit for bit on a VNNI CPU), the file grows by the copies
//! (~1 MB for hibari).
//!
//! It works on the protobuf wire format directly (ModelProto field 7 = graph; GraphProto field 1 =
//! node, 5 = initializer; NodeProto field 1 = input, 4 = op_type; TensorProto field 8 = name), so
//! the crate needs no ONNX schema; every other field is copied byte for byte.

use std::collections::HashMap;

/// Operators whose int8 weights ONNX Runtime's precision transformer rewrites.
const INTEGER_PRODUCTS: [&str; 6] = [
    "MatMulInteger",
    "ConvInteger",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
    "QLinearConv",
    "QGemm",
];

/// A malformed protobuf (the caller then loads the file as it is and lets ONNX Runtime report).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Malformed(&'static str);

/// One field of a message: its number, wire type, whole encoding, and payload where
/// length-delimited.
struct Field<'a> {
    number: u64,
    raw: &'a [u8],
    payload: Option<&'a [u8]>,
}

fn varint(bytes: &[u8], at: &mut usize) -> Result<u64, Malformed> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *bytes.get(*at).ok_or(Malformed("truncated varint"))?;
        *at += 1;
        value |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(Malformed("varint longer than 10 bytes"))
}

fn fields(bytes: &[u8]) -> Result<Vec<Field<'_>>, Malformed> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let start = at;
        let key = varint(bytes, &mut at)?;
        let payload = match key & 7 {
            0 => {
                varint(bytes, &mut at)?;
                None
            }
            1 => {
                at += 8;
                None
            }
            5 => {
                at += 4;
                None
            }
            2 => {
                let len = usize::try_from(varint(bytes, &mut at)?)
                    .map_err(|_| Malformed("length overflows"))?;
                let end = at.checked_add(len).ok_or(Malformed("length overflows"))?;
                let p = bytes.get(at..end).ok_or(Malformed("truncated field"))?;
                at = end;
                Some(p)
            }
            _ => return Err(Malformed("unsupported wire type")),
        };
        if at > bytes.len() {
            return Err(Malformed("truncated field"));
        }
        out.push(Field {
            number: key >> 3,
            raw: &bytes[start..at],
            payload,
        });
    }
    Ok(out)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_bytes(out: &mut Vec<u8>, number: u64, payload: &[u8]) {
    put_varint(out, number << 3 | 2);
    put_varint(out, payload.len() as u64);
    out.extend_from_slice(payload);
}

fn string_field(msg: &[u8], number: u64) -> Result<Option<&[u8]>, Malformed> {
    Ok(fields(msg)?
        .into_iter()
        .find(|f| f.number == number)
        .and_then(|f| f.payload))
}

/// The model with each weight that several integer-product nodes share copied per node, or
/// `None` when nothing is shared (load the original).
pub(crate) fn unshare_integer_weights(model: &[u8]) -> Result<Option<Vec<u8>>, Malformed> {
    let model_fields = fields(model)?;
    let Some(graph) = model_fields
        .iter()
        .find(|f| f.number == 7)
        .and_then(|f| f.payload)
    else {
        return Ok(None);
    };
    let graph_fields = fields(graph)?;
    let mut initializers: HashMap<&[u8], &[u8]> = HashMap::new();
    for f in graph_fields.iter().filter(|f| f.number == 5) {
        let tensor = f.payload.ok_or(Malformed("initializer is not a message"))?;
        if let Some(name) = string_field(tensor, 8)? {
            initializers.insert(name, tensor);
        }
    }
    let mut uses: HashMap<&[u8], usize> = HashMap::new();
    let mut copies: Vec<Vec<u8>> = Vec::new(); // new TensorProto payloads
    let mut nodes: Vec<Option<Vec<u8>>> = Vec::with_capacity(graph_fields.len()); // re-encoded
    for f in &graph_fields {
        let node = match (f.number, f.payload) {
            (1, Some(node)) => node,
            _ => {
                nodes.push(None);
                continue;
            }
        };
        let node_fields = fields(node)?;
        let op = node_fields
            .iter()
            .find(|n| n.number == 4)
            .and_then(|n| n.payload);
        if !op.is_some_and(|op| INTEGER_PRODUCTS.iter().any(|p| p.as_bytes() == op)) {
            nodes.push(None);
            continue;
        }
        let mut rewritten = Vec::with_capacity(node.len() + 32);
        let mut changed = false;
        for nf in &node_fields {
            let input = match (nf.number, nf.payload) {
                (1, Some(input)) if initializers.contains_key(input) => input,
                _ => {
                    rewritten.extend_from_slice(nf.raw);
                    continue;
                }
            };
            let n = uses.entry(input).or_insert(0);
            *n += 1;
            if *n == 1 {
                rewritten.extend_from_slice(nf.raw);
                continue;
            }
            let mut name = input.to_vec();
            name.extend_from_slice(format!("__omni_use{n}").as_bytes());
            copies.push(renamed_tensor(initializers[input], &name)?);
            put_bytes(&mut rewritten, 1, &name);
            changed = true;
        }
        nodes.push(changed.then_some(rewritten));
    }
    if copies.is_empty() {
        return Ok(None);
    }
    let mut new_graph =
        Vec::with_capacity(graph.len() + copies.iter().map(Vec::len).sum::<usize>());
    for (f, node) in graph_fields.iter().zip(&nodes) {
        match node {
            Some(node) => put_bytes(&mut new_graph, 1, node),
            None => new_graph.extend_from_slice(f.raw),
        }
    }
    for tensor in &copies {
        put_bytes(&mut new_graph, 5, tensor);
    }
    let mut out = Vec::with_capacity(model.len() + new_graph.len() - graph.len());
    for f in &model_fields {
        if f.number == 7 {
            put_bytes(&mut out, 7, &new_graph);
        } else {
            out.extend_from_slice(f.raw);
        }
    }
    Ok(Some(out))
}

/// A TensorProto's encoding with its name (field 8) replaced.
fn renamed_tensor(tensor: &[u8], name: &[u8]) -> Result<Vec<u8>, Malformed> {
    let mut out = Vec::with_capacity(tensor.len() + 16);
    for f in fields(tensor)? {
        if f.number == 8 {
            put_bytes(&mut out, 8, name);
        } else {
            out.extend_from_slice(f.raw);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(op: &str, inputs: &[&str], output: &str) -> Vec<u8> {
        let mut n = Vec::new();
        for i in inputs {
            put_bytes(&mut n, 1, i.as_bytes());
        }
        put_bytes(&mut n, 2, output.as_bytes());
        put_bytes(&mut n, 4, op.as_bytes());
        n
    }

    fn tensor(name: &str, data: &[u8]) -> Vec<u8> {
        let mut t = Vec::new();
        put_varint(&mut t, 1 << 3); // dims: 4
        put_varint(&mut t, data.len() as u64);
        put_varint(&mut t, 2 << 3); // data_type: int8 (3)
        put_varint(&mut t, 3);
        put_bytes(&mut t, 8, name.as_bytes());
        put_bytes(&mut t, 9, data); // raw_data
        t
    }

    fn model(graph_parts: &[(u64, Vec<u8>)]) -> Vec<u8> {
        let mut g = Vec::new();
        for (n, p) in graph_parts {
            put_bytes(&mut g, *n, p);
        }
        let mut m = Vec::new();
        put_varint(&mut m, 1 << 3); // ir_version: 8
        put_varint(&mut m, 8);
        put_bytes(&mut m, 7, &g);
        put_bytes(&mut m, 2, b"producer");
        m
    }

    /// (op, inputs) of every node, and (name, raw_data) of every initializer.
    type Parsed = (Vec<(String, Vec<String>)>, Vec<(String, Vec<u8>)>);

    fn parse(m: &[u8]) -> Parsed {
        let s = |b: &[u8]| String::from_utf8(b.to_vec()).expect("utf-8");
        let g = string_field(m, 7).expect("parses").expect("graph");
        let (mut nodes, mut inits) = (Vec::new(), Vec::new());
        for f in fields(g)
            .expect("graph parses")
            .into_iter()
            .filter(|f| matches!(f.number, 1 | 5))
        {
            let p = f.payload.expect("message");
            let sub = fields(p).expect("parses");
            let get = |k| {
                sub.iter()
                    .filter(move |x| x.number == k)
                    .map(|x| x.payload.expect("bytes"))
            };
            match f.number {
                1 => nodes.push((s(get(4).next().expect("op_type")), get(1).map(s).collect())),
                5 => inits.push((
                    s(get(8).next().expect("name")),
                    get(9).next().expect("raw_data").to_vec(),
                )),
                _ => {}
            }
        }
        (nodes, inits)
    }

    #[test]
    fn each_later_use_of_a_shared_weight_gets_its_own_copy() {
        let m = model(&[
            (5, tensor("w", &[1, 2, 3, 4])),
            (5, tensor("zp", &[0])),
            (1, node("MatMulInteger", &["a", "w", "", "zp"], "y1")),
            (1, node("Mul", &["y1", "w"], "m")),
            (1, node("MatMulInteger", &["b", "w", "", "zp"], "y2")),
            (1, node("MatMulInteger", &["c", "w", "", "zp"], "y3")),
            (3, b"graph-name".to_vec()),
        ]);
        let out = unshare_integer_weights(&m)
            .expect("parses")
            .expect("rewritten");
        let (nodes, inits) = parse(&out);
        let ins = |i: usize| nodes[i].1.iter().map(String::as_str).collect::<Vec<_>>();
        assert_eq!(ins(0), ["a", "w", "", "zp"]);
        assert_eq!(ins(1), ["y1", "w"], "other operators keep the shared name");
        assert_eq!(ins(2), ["b", "w__omni_use2", "", "zp__omni_use2"]);
        assert_eq!(ins(3), ["c", "w__omni_use3", "", "zp__omni_use3"]);
        let names: Vec<&str> = inits.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "w",
                "zp",
                "w__omni_use2",
                "zp__omni_use2",
                "w__omni_use3",
                "zp__omni_use3"
            ]
        );
        for (name, data) in &inits {
            let want: &[u8] = if name.starts_with("zp") {
                &[0]
            } else {
                &[1, 2, 3, 4]
            };
            assert_eq!(data, want, "{name} keeps its bytes");
        }
        // The model's other fields survive, byte for byte.
        assert_eq!(
            string_field(&out, 2).expect("parses"),
            Some(&b"producer"[..])
        );
        assert_eq!(&out[..2], &m[..2]);
        let g = string_field(&out, 7).expect("parses").expect("graph");
        assert_eq!(
            string_field(g, 3).expect("parses"),
            Some(&b"graph-name"[..])
        );
    }

    #[test]
    fn a_graph_without_shared_weights_is_left_alone() {
        let m = model(&[
            (5, tensor("w1", &[1])),
            (5, tensor("w2", &[2])),
            (1, node("MatMulInteger", &["a", "w1"], "y1")),
            (1, node("MatMulInteger", &["b", "w2"], "y2")),
            (1, node("Add", &["y1", "w1"], "z")),
        ]);
        assert_eq!(unshare_integer_weights(&m), Ok(None));
    }

    #[test]
    fn malformed_bytes_are_an_error_not_a_panic() {
        let m = model(&[(1, node("MatMulInteger", &["a", "w"], "y"))]);
        for cut in 1..m.len() {
            let _ = unshare_integer_weights(&m[..cut]);
        }
        assert!(unshare_integer_weights(&[0x3a, 0xff]).is_err());
        assert!(unshare_integer_weights(&[0x0b]).is_err(), "group wire type");
    }
}
