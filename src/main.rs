fn main() {
    println!(
        "mlx {} backend {} gpus {}",
        mlxcel::mlx::version(),
        mlxcel::mlx::backend(),
        mlxcel::mlx::gpu_device_count()
    );
}
