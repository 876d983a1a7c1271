fn main() {
    let obj = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy"));
    println!("{}", obj.len());
}
